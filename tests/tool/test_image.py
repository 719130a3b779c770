"""`apply.py image`, built for real with buildah.

The official vllm/vllm-openai images cannot be pulled here, so the base is a
stand-in built locally the way the official image holds vLLM: Debian's
system Python (no virtual environment), the release's vLLM wheel installed
by pip without bytecode into /usr/local's dist-packages, and the packages it
imports (the test environment's, CPU torch). On it, `apply.py image` builds
the tq-v0.33 image (the docs' command, with --from the stand-in), the checks
run inside the image, and the wrong cases fail the build with their reasons.

Needs root, buildah and mmdebstrap (ci/test.sh installs them with apt-get);
else skipped. The stand-in's Debian root and the image store are kept in
build/image/ across runs (a stand-in is rebuilt when the test environment or
the release wheel changes).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from conftest import APPLY, ROOT, isolated_cache
from test_faults import interrupted
from test_warm import DEFAULT_SIGINT

PY = sys.executable
STORE = ROOT / "build" / "image"
RELEASE = "0.33.0"
STANDIN = "localhost/vllm-standin"
TQ = "vllm/v1/attention/backends/turboquant_attn.py"
SITE = "/usr/local/lib/python3.11/dist-packages"


def _stack_files() -> dict[str, set[str]]:
    """Each tq-v0.33 patch of the series (its number) and the vLLM files it
    changes."""
    text = (ROOT / "series").read_text()
    entries = re.findall(r"^(tq-v0\.33/\S+\.patch)$", text, re.M)
    return {e.split("/")[1][:4]: set(re.findall(
        r"^diff --git a/(\S+) ", (ROOT / "patches" / e).read_text(), re.M))
        for e in entries}


STACK_FILES = _stack_files()
PATCHES = list(STACK_FILES)
FILES = len(set().union(*STACK_FILES.values()))
# UltraQuant's module uses Triton at import: noted in the image, not counted.
MODULES = FILES - 1

STANDIN_FILE = f"""\
FROM scratch
ADD rootfs.tar /
COPY site-packages/ {SITE}/
COPY vllm-{RELEASE}-*.whl /tmp/
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-deps --no-index \\
        --no-compile --no-cache-dir /tmp/vllm-*.whl && rm /tmp/vllm-*.whl
CMD ["python3"]
"""


def tool(*args: str, env: dict[str, str], cwd: Path,
         timeout: int = 1500) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PY, str(APPLY), *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


def test_no_builder_is_bad_input(tmp_path: Path) -> None:
    """No docker, podman or buildah on PATH: one line, exit 2, nothing else
    done (no wheel, no download)."""
    env = dict(os.environ, PATH=str(tmp_path), VLLM_PATCHES_OFFLINE="1")
    r = tool("image", "--stack", "tq-v0.33", "--out", str(tmp_path / "dist"),
             env=env, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [(
        "apply.py: error: no image builder: install docker, podman or buildah "
        "(or name one on PATH with --builder)")]
    r = tool("image", "--builder", "docker", "--out", str(tmp_path / "dist"),
             env=env, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "apply.py: error: --builder docker: 'docker' is not on PATH")
    assert not (tmp_path / "dist").exists()


pytestmark_real = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("buildah")
    or not shutil.which("mmdebstrap"),
    reason="needs root, buildah and mmdebstrap (ci/test.sh installs them)")


def buildah(*args: str, env: dict[str, str],
            check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["buildah", *args], env=env, capture_output=True,
                       text=True, stdin=subprocess.DEVNULL, timeout=900)
    assert r.returncode == 0 or not check, r.stdout + r.stderr
    return r


@pytest.fixture(scope="module")
def benv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment buildah runs in: its store in build/image/, chroot
    isolation (no daemon, no user namespaces), the tool's cache of the
    test's own sharing the downloaded release wheels."""
    STORE.mkdir(parents=True, exist_ok=True)
    overlay = "overlay" in Path("/proc/filesystems").read_text()
    conf = STORE / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "{"overlay" if overlay else "vfs"}"\n'
                    f'graphroot = "{STORE / "store"}"\n'
                    f'runroot = "{STORE / "run"}"\n')
    tmp = tmp_path_factory.mktemp("image")
    return dict(os.environ, CONTAINERS_STORAGE_CONF=str(conf),
                BUILDAH_ISOLATION="chroot",
                VLLM_PATCHES_CACHE=str(isolated_cache(tmp)))


@pytest.fixture(scope="module")
def built(benv: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The docs' command on the stand-in: the wheel made, the image built."""
    tmp = tmp_path_factory.mktemp("built")
    standin = standin_image(benv, tmp)
    r = tool("image", "--stack", "tq-v0.33", "--builder", "buildah", "--from",
             standin, "--out", str(tmp / "dist"), "--json",
             str(tmp / "image.json"), env=benv, cwd=tmp)
    print(r.stdout[-3000:])
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr
    rep = json.loads((tmp / "image.json").read_text())
    yield {**rep, "tmp": tmp, "standin": standin, "stdout": r.stdout}
    buildah("rmi", rep["image"], env=benv, check=False)


def standin_image(env: dict[str, str], tmp: Path) -> str:
    """A stand-in of vllm/vllm-openai:v0.33.0, built unless the store has
    it for this test environment and release wheel."""
    wheels = sorted((Path(env["VLLM_PATCHES_CACHE"]) / "dist").glob(
        f"vllm-{RELEASE}-*.whl"))
    if not wheels:  # `apply.py wheel` downloads it
        r = tool("wheel", "--stack", "tq-v0.33", "--out", str(tmp / "dist"),
                 env=env, cwd=tmp)
        assert r.returncode == 0, r.stdout + r.stderr
        wheels = sorted((Path(env["VLLM_PATCHES_CACHE"]) / "dist").glob(
            f"vllm-{RELEASE}-*.whl"))
    site = Path(next(p for p in sys.path if p.endswith("site-packages")))
    key = hashlib.sha256(
        f"{wheels[0].name}\n{STANDIN_FILE}".encode()
        + (ROOT / ".venv" / ".setup-stamp").read_bytes()).hexdigest()[:12]
    ref = f"{STANDIN}:v{RELEASE}-{key}"
    if buildah("inspect", "--type", "image", ref, env=env,
               check=False).returncode == 0:
        return ref
    rootfs = STORE / "rootfs.tar"
    if not rootfs.is_file():
        subprocess.run(["mmdebstrap", "--variant=apt", "--format=tar", "--quiet",
                        "--include=python3,python3-pip", "bookworm",
                        str(rootfs) + ".part"], check=True, timeout=900)
        os.replace(str(rootfs) + ".part", rootfs)
    ctx = STORE / "standin"
    shutil.rmtree(ctx, ignore_errors=True)
    ctx.mkdir()
    link(rootfs, ctx / "rootfs.tar")
    link(wheels[0], ctx / wheels[0].name)
    shutil.copytree(site, ctx / "site-packages", copy_function=link,
                    ignore=shutil.ignore_patterns("__pycache__"))
    (ctx / "Containerfile").write_text(STANDIN_FILE)
    buildah("bud", "-f", str(ctx / "Containerfile"), "-t", ref, str(ctx),
            env=env)
    shutil.rmtree(ctx)
    return ref


def link(src: str | Path, dst: str | Path) -> None:
    """A hard link, else a copy (another file system)."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def in_image(image: str, env: dict[str, str], *cmd: str,
             copy: Path | None = None) -> str:
    """`cmd` run inside a container of `image` (with `copy` at /tmp/project)."""
    ctr = buildah("from", image, env=env).stdout.strip().splitlines()[-1]
    try:
        if copy:
            buildah("copy", ctr, str(copy), "/tmp/project", env=env)
        return buildah("run", ctr, "--", *cmd, env=env).stdout
    finally:
        buildah("rm", ctr, env=env, check=False)


@pytestmark_real
def test_image_builds_and_checks_inside(built: dict, benv: dict[str, str]) -> None:
    out = built["stdout"]
    version = built["version"]
    assert version.startswith(f"{RELEASE}+tqv033.")
    assert built["image"] == f"vllm-openai:v{version.replace('+', '-')}"
    assert out.startswith(built["image"] + "\n") or f"\n{built['image']}\n" in out
    assert f"image-smoke: the base image has vllm {RELEASE}: ok" in out
    n = len(PATCHES)
    assert (f"image-smoke: vllm {version} (stack tq-v0.33, {n} patch(es)): "
            f"{n} in effect, {FILES} of {FILES} file(s) as built, {MODULES} "
            "patched module(s) imported: ok") in out
    assert "podman run --device nvidia.com/gpu=all -p 8000:8000 " \
        f"{built['image']} MODEL" in out
    # inside the image: the tool's check a user runs, from a copy of the
    # project; the stage is gone, nothing compiled into vllm
    proj = built["tmp"] / "project"
    for f in ("apply.py", "series"):
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / f, proj / f)
    shutil.copytree(ROOT / "applylib", proj / "applylib",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "patches", proj / "patches")
    got = in_image(
        built["image"], benv, "sh", "-ec",
        "cd /tmp && VLLM_PATCHES_CACHE=/tmp/c python3 -B /tmp/project/apply.py "
        "status --installed --no-tests --offline --json /tmp/s.json "
        ">/dev/null || true; cat /tmp/s.json; echo @@; ls /tmp; "
        f"find {SITE}/vllm -name '*.pyc' | wc -l", copy=proj)
    report, rest = got.split("@@\n", 1)
    rep = json.loads(report)
    assert rep["exit_code"] == 0
    assert rep["vllm"]["version"] == version
    assert [(p["file"].split("/")[1][:4], p["installed"])
            for p in rep["stacks"][0]["patches"]] == \
        [(n, "in-effect") for n in PATCHES]
    assert "vllm.v1.attention.backends.turboquant_attn" in rep["imports"]["ok"]
    assert rep["imports"]["failed"] == {}
    *listing, pycs = rest.split()
    assert "vllm-patched" not in listing and pycs == "0"  # no stage, bytecode


@pytestmark_real
def test_image_fails_on_a_tampered_file(built: dict, benv: dict[str, str]) -> None:
    """A patched file altered in the wheel: the smoke check fails the build,
    exit 1, the builder's lines say which file."""
    good = Path(built["wheel"])
    bad = built["tmp"] / "tampered" / good.name
    bad.parent.mkdir()
    with zipfile.ZipFile(good) as zin, zipfile.ZipFile(bad, "w") as zout:
        for info in zin.infolist():  # stored: fast, and pip does not mind
            data = zin.read(info)
            if info.filename == TQ:
                data += b"# tampered\n"
            zout.writestr(info.filename, data, zipfile.ZIP_STORED)
    r = tool("image", "--stack", "tq-v0.33", "--builder", "buildah", "--from",
             built["standin"], "--wheel", str(bad), "--tag", "localhost/bad:1",
             env=benv, cwd=built["tmp"])
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr
    assert (f"tq-v0.33/0001: modified: {TQ} (neither the patched nor the "
            "release's content)") in r.stdout
    untouched = sum(TQ not in files for files in STACK_FILES.values())
    assert r.stdout.rstrip().endswith(
        "image-smoke: FAILED: apply.py status --installed: exit 1\n"
        f"  image-smoke: vllm {built['version']} (stack tq-v0.33, "
        f"{len(PATCHES)} patch(es)): {untouched} in effect, {FILES - 1} of "
        f"{FILES} file(s) as built, {MODULES} patched module(s) imported: FAILED")
    assert buildah("inspect", "--type", "image", "localhost/bad:1", env=benv,
                   check=False).returncode != 0


@pytestmark_real
def test_image_fails_with_a_wheel_of_another_release(
        built: dict, benv: dict[str, str]) -> None:
    """The tq stack's wheel (vLLM 0.20.2) over the 0.33.0 stand-in: refused
    before it is installed, exit 1. Given for the tq-v0.33 stack, the same
    wheel is bad input: exit 2, nothing built."""
    tmp = built["tmp"]
    r = tool("image", "--stack", "tq", "--builder", "buildah", "--from",
             built["standin"], "--out", str(tmp / "dist-tq"), "--tag",
             "localhost/bad:2", env=benv, cwd=tmp)
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr
    assert r.stdout.rstrip().endswith(
        f"image-smoke: FAILED: the base image has vllm {RELEASE}, the wheel "
        "is of release 0.20.2: build FROM the vllm/vllm-openai:v0.20.2 image "
        "(or an image with that release), or make the wheel of the image's "
        "release")
    tq_wheel = next((tmp / "dist-tq").glob("vllm-0.20.2+tq.*.whl"))
    r = tool("image", "--stack", "tq-v0.33", "--builder", "buildah", "--from",
             built["standin"], "--wheel", str(tq_wheel), env=benv, cwd=tmp)
    assert r.returncode == 2, r.stdout[-4000:] + r.stderr
    assert r.stderr.strip() == (
        f"apply.py: error: {tq_wheel.name} is of vLLM 0.20.2, the stack tq-v0.33 of "
        f"release {RELEASE}: give that release's wheel")


@pytestmark_real
def test_image_by_hand_fails_with_another_series(
        built: dict, benv: dict[str, str]) -> None:
    """The Dockerfile's own command from a project root (the .dockerignore
    beside it), with a project copy whose series is not the wheel's: the
    smoke check fails the build. apply.py image refuses it up front."""
    proj = built["tmp"] / "other"
    for f in ("apply.py", "series", "README.md", "ci/Dockerfile.serving",
              "ci/Dockerfile.serving.dockerignore", "ci/image-smoke.py"):
        (proj / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / f, proj / f)
    for d in ("applylib", "patches"):
        shutil.copytree(ROOT / d, proj / d)
    patch = next((proj / "patches" / "tq-v0.33").glob("0003-*.patch"))
    patch.write_text(patch.read_text().replace("\n---\n", "\nReworded.\n---\n", 1))
    wheel = Path(built["wheel"])
    (proj / "dist").mkdir()
    link(wheel, proj / "dist" / wheel.name)
    r = subprocess.run(
        ["buildah", "bud", "-f", "ci/Dockerfile.serving", "--ignorefile",
         "ci/Dockerfile.serving.dockerignore", "--build-arg",
         f"BASE_IMAGE={built['standin']}", "--build-arg",
         f"WHEEL=dist/{wheel.name}", "-t", "localhost/bad:3", "."],
        cwd=proj, env=benv, capture_output=True, text=True, timeout=900)
    assert r.returncode != 0, r.stdout[-4000:]
    assert ("image-smoke: FAILED: the project copy's series (/tmp/vllm-patched/"
            "project/series) is not the one the wheel was made from (stack "
            "tq-v0.33, digest") in r.stdout
    r = tool("image", "--series", str(proj / "series"), "--stack", "tq-v0.33",
             "--builder", "buildah", "--from", built["standin"], "--wheel",
             str(wheel), env=benv, cwd=built["tmp"])
    assert r.returncode == 2, r.stdout[-4000:] + r.stderr
    assert r.stderr.strip() == (
        f"apply.py: error: {wheel.name} was made from stack tq-v0.33 of another "
        f"series than {proj / 'series'}: make it again with apply.py wheel")


@pytestmark_real
def test_image_unknown_base_image(built: dict, benv: dict[str, str]) -> None:
    r = tool("image", "--stack", "tq-v0.33", "--builder", "buildah", "--from",
             "localhost/no-such-image:1", "--out", str(built["tmp"] / "dist"),
             env=benv, cwd=built["tmp"])
    assert r.returncode == 2, r.stdout[-4000:] + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "apply.py: error: base image localhost/no-such-image:1: not in buildah's "
        "images and it cannot be pulled (")


FAKE_DOCKER = """\
#!/bin/sh
echo "$*" >> "$DOCKER_LOG"
if [ "$1" = build ]; then
  for a; do ctx=$a; done
  (cd "$ctx" && find . -type f | sort) >> "$DOCKER_LOG"
  echo "image-smoke: (a stand-in docker)"
fi
"""


@pytestmark_real
def test_image_with_docker_defaults(built: dict, tmp_path: Path) -> None:
    """With docker first on PATH (a stand-in that logs what it is given):
    the official image of the release as base, the tag, the build
    arguments, and a context of exactly what the Dockerfile copies."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text(FAKE_DOCKER)
    (tmp_path / "bin" / "docker").chmod(0o755)
    log = tmp_path / "docker.log"
    env = dict(os.environ, DOCKER_LOG=str(log),
               PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    wheel = Path(built["wheel"])
    r = tool("image", "--stack", "tq-v0.33", "--wheel", str(wheel), env=env,
             cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    tag = built["image"]
    lines = r.stdout.splitlines()
    at = lines.index(tag)
    assert re.fullmatch(
        rf"  vllm {re.escape(built['version'])}: stack tq-v0.33 "
        rf"\({len(PATCHES)} patch\(es\)\) "
        rf"over vllm/vllm-openai:v{RELEASE}, built by docker in \d+ s",
        lines[at + 1])
    assert lines[at + 2:] == [
        "  image-smoke: (a stand-in docker)",
        "to run it:",
        f"  docker run --gpus all -p 8000:8000 {tag} MODEL --kv-cache-dtype "
        "turboquant_4bit_nc"]
    inspect, build, *files = log.read_text().splitlines()
    assert inspect == f"image inspect vllm/vllm-openai:v{RELEASE}"
    ctx = build.split()[-1]
    assert build == (
        f"build --build-arg VLLM_RELEASE={RELEASE} --build-arg BASE_IMAGE="
        f"vllm/vllm-openai:v{RELEASE} --build-arg WHEEL=dist/{wheel.name} -f "
        f"{ctx}/Dockerfile -t {tag} {ctx}")
    assert Path(ctx).parent == wheel.parent and not Path(ctx).exists()
    want = ["./Dockerfile", "./apply.py", "./series", "./ci/image-smoke.py",
            f"./dist/{wheel.name}"]
    want += [f"./applylib/{f.name}" for f in (ROOT / "applylib").glob("*.py")]
    want += [f"./{f.relative_to(ROOT).as_posix()}"
             for f in (ROOT / "patches").rglob("*") if f.is_file()]
    assert sorted(files) == sorted(want)


SLOW_DOCKER = """\
#!/bin/sh
if [ "$1" = build ]; then
  echo "STEP 1/4: FROM (a stand-in docker that hangs)"
  exec sleep 300
fi
"""


@pytestmark_real
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_interrupt_during_the_build(built: dict, tmp_path: Path,
                                    sig: signal.Signals, code: int) -> None:
    """Ctrl-C (to the process group) or SIGTERM (to apply.py, as a CI
    job's timeout sends it) while the builder runs: exit 130 / 143, one
    line, the builder gone, the build context removed. Before, SIGTERM
    waited for the builder to finish."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "docker").write_text(SLOW_DOCKER)
    (tmp_path / "bin" / "docker").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    wheel = Path(built["wheel"])
    cmd = [PY, "-c", DEFAULT_SIGINT, str(APPLY), "image", "--stack", "tq-v0.33",
           "--wheel", str(wheel)]

    def building(proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "a stand-in docker that hangs" in line:
                break
        time.sleep(0.5)

    rc, out, running = interrupted(cmd, env, tmp_path, sig, building)
    assert rc == code, out
    assert out.strip().splitlines()[-1].startswith("apply.py: interrupted"), out
    assert "Traceback" not in out, out
    assert not running, f"left running: {running}"
    assert not list(wheel.parent.glob(".apply-image-*"))
