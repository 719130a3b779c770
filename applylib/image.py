"""apply.py image: the serving image of a stack, built with the builder at hand.

The official OpenAI-server image of the stack's release (or --from IMAGE)
with the patched wheel of `apply.py wheel` installed over its vLLM, as
ci/Dockerfile.serving says, and checked at build time by ci/image-smoke.py
(`apply.py status --installed` inside the image). The build context is a
folder of its own holding only what that Dockerfile copies.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
import time
import zipfile
from pathlib import Path

from .core import PROJECT, UserError, child_output, command, say
from .series import Series, Stack
from .wheelbuild import (
    WHEEL_MANIFEST,
    WheelJob,
    add_wheel_options,
    make_wheel,
    wheel_job,
)

BUILDERS = ("docker", "podman", "buildah")
DOCKERFILE = PROJECT / "ci" / "Dockerfile.serving"
SMOKE = "ci/image-smoke.py"


def cmd_image(args: argparse.Namespace) -> int:
    """Find the builder, the base image and the patched wheel; build."""
    t_start = time.monotonic()
    builder = find_builder(args.builder)
    job = wheel_job(args)
    base_image = args.base_image or f"vllm/vllm-openai:v{job.release}"
    have_base_image(builder, base_image)
    wheel = patched_wheel(args, job)
    if wheel is None:
        return 1
    tag = args.tag or f"vllm-openai:v{job.release}-{job.local}"
    say(f"apply.py image: {builder} build of {tag} from {base_image} + {wheel.name}")
    with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".apply-image-") as tmp:
        context = build_context(Path(tmp), wheel, job.series)
        build = run_build(builder, context, job.release, base_image, wheel, tag)
    seconds = time.monotonic() - t_start
    report_image(args, build, job, base_image, wheel, seconds)
    return 0 if build.rc == 0 else 1


def find_builder(name: str | None) -> str:
    """The image builder: the one named, else docker, podman, buildah, the
    first on PATH."""
    for b in [name] if name else BUILDERS:
        if shutil.which(b):
            return b
    if name:
        raise UserError(f"--builder {name}: '{name}' is not on PATH")
    raise UserError(
        "no image builder: install docker, podman or buildah (or name one "
        "on PATH with --builder)"
    )


def builder_run(builder: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [builder, *argv],
        check=False,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )


def have_base_image(builder: str, image: str) -> None:
    """The base image is in the builder's store, or pulled there now."""
    inspect = "inspect --type image" if builder == "buildah" else "image inspect"
    if builder_run(builder, *inspect.split(), image).returncode == 0:
        return
    say(f"apply.py image: pulling {image}")
    proc = builder_run(builder, "pull", image)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["?"])[-1]
        raise UserError(
            f"base image {image}: not in {builder}'s images and it cannot be "
            f"pulled ({last}); give one that is with --from"
        )


def patched_wheel(args: argparse.Namespace, job: WheelJob) -> Path | None:
    """--wheel, else the wheel `apply.py wheel` made in --out (reused), else
    made now; checked to be of this stack, release and series."""
    if args.wheel:
        wheel = Path(args.wheel).expanduser().resolve()
    else:
        out = Path(args.out).expanduser().resolve()
        made = sorted(out.glob(f"vllm-{job.version}-*.whl"))
        if made:
            wheel = made[-1]
            say(f"apply.py image: reusing {wheel}")
        else:
            wheel = make_wheel(argparse.Namespace(**{**vars(args), "json": None}), job)
            if wheel is None:
                return None
    check_patched_wheel(wheel, job.series, job.stack, job.release)
    return wheel


def check_patched_wheel(
    wheel: Path, series: Series, stack: Stack, release: str
) -> None:
    """A wheel of `apply.py wheel` from this series' `stack` on `release`."""
    if not wheel.is_file():
        raise UserError(f"{wheel}: no such wheel file")
    try:
        with zipfile.ZipFile(wheel) as zf:
            name = next(
                (
                    n
                    for n in zf.namelist()
                    if n.endswith(f".dist-info/{WHEEL_MANIFEST}")
                ),
                None,
            )
            manifest = json.loads(zf.read(name)) if name else None
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"{wheel}: not a readable wheel ({e})") from None
    if manifest is None:
        raise UserError(f"{wheel.name}: not a wheel made by apply.py wheel")
    if manifest["release"] != release:
        raise UserError(
            f"{wheel.name} is of vLLM {manifest['release']}, the stack "
            f"{stack.name} of release {release}: give that release's wheel"
        )
    if (manifest["stack"], manifest["series_sha256"]) != (
        stack.name,
        series.digest(stack),
    ):
        raise UserError(
            f"{wheel.name} was made from stack {manifest['stack']} of another "
            f"series than {series.path}: make it again with apply.py wheel"
        )


def build_context(ctx: Path, wheel: Path, series: Series) -> Path:
    """What ci/Dockerfile.serving copies, and nothing else: the wheel (a hard
    link where it can be), the tool, the series and its patches, the smoke
    check."""
    (ctx / "dist").mkdir()
    try:
        os.link(wheel, ctx / "dist" / wheel.name)
    except OSError:
        shutil.copyfile(wheel, ctx / "dist" / wheel.name)
    (ctx / "applylib").mkdir()
    for f in (PROJECT / "applylib").glob("*.py"):
        shutil.copyfile(f, ctx / "applylib" / f.name)
    for f in ("apply.py", SMOKE):
        (ctx / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(PROJECT / f, ctx / f)
    shutil.copyfile(series.path, ctx / "series")
    shutil.copytree(series.patches_dir, ctx / "patches")
    shutil.copyfile(DOCKERFILE, ctx / "Dockerfile")
    return ctx


@dataclasses.dataclass
class Build:
    """The builder's run: its command, exit status and what it printed."""

    argv: list[str]
    rc: int
    lines: list[str]


def run_build(
    builder: str, ctx: Path, release: str, base_image: str, wheel: Path, tag: str
) -> Build:
    """The builder on the context, its output shown as it comes."""
    argv = [builder, "bud" if builder == "buildah" else "build"]
    for k, v in (
        ("VLLM_RELEASE", release),
        ("BASE_IMAGE", base_image),
        ("WHEEL", f"dist/{wheel.name}"),
    ):
        argv += ["--build-arg", f"{k}={v}"]
    argv += ["-f", str(ctx / "Dockerfile"), "-t", tag, str(ctx)]
    lines = []
    with child_output(argv) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"  | {line}", end="", flush=True)
            lines.append(line.rstrip("\n"))
    return Build(argv, proc.returncode, lines)


def report_image(
    args: argparse.Namespace,
    build: Build,
    job: WheelJob,
    base_image: str,
    wheel: Path,
    seconds: float,
) -> None:
    """The image and how to run it; or why the build failed."""
    tag = build.argv[build.argv.index("-t") + 1]
    smoke = [ln.strip() for ln in build.lines if "image-smoke:" in ln]
    if build.rc != 0:
        why = [ln for ln in smoke if "FAILED" in ln] or build.lines[-3:]
        print(f"apply.py image: the build failed ({build.argv[0]} exit {build.rc}):")
        for ln in why:
            print(f"  {ln}")
    else:
        docker = build.argv[0] == "docker"
        gpus = "--gpus all" if docker else "--device nvidia.com/gpu=all"
        run = "docker" if docker else "podman"
        print(tag)
        print(
            f"  vllm {job.version}: stack {job.stack.name} ({len(job.patches)} "
            f"patch(es)) over {base_image}, built by {build.argv[0]} in {seconds:.0f} s"
        )
        for ln in smoke:
            print(f"  {ln}")
        print(
            f"to run it:\n  {run} run {gpus} -p 8000:8000 {tag} MODEL "
            "--kv-cache-dtype turboquant_4bit_nc"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "image": tag if build.rc == 0 else None,
                    "builder": build.argv[0],
                    "base_image": base_image,
                    "wheel": str(wheel),
                    "version": job.version,
                    "exit_code": build.rc,
                    "smoke": smoke,
                    "seconds": round(seconds, 1),
                },
                indent=2,
            )
            + "\n"
        )


def add_image_command(sub: argparse._SubParsersAction) -> None:
    """apply.py image: the serving image of a stack."""
    m = command(
        sub,
        "image",
        cmd_image,
        help="serving image: the official vLLM image with the patched wheel",
        description="Build the serving image of a stack: the patched wheel "
        "(apply.py wheel's, reused from --out when it is there), installed "
        "over the vLLM of the official vllm/vllm-openai image of the stack's "
        "release (or --from IMAGE) by ci/Dockerfile.serving, with docker, "
        "podman or buildah (the first on PATH, or --builder). The build runs "
        "apply.py status --installed inside the image and fails unless every "
        "patch is in effect. The tag names the release, the stack and the "
        "series digest.",
        epilog="example:\n  python apply.py image --stack tq-v0.33\n"
        "  python apply.py image --stack tq-v0.33 --builder buildah "
        "--from mirror.example/vllm-openai:v0.33.0",
    )
    add_wheel_options(m)
    m.add_argument(
        "--builder", choices=BUILDERS, help="image builder (default: the first on PATH)"
    )
    m.add_argument(
        "--from",
        dest="base_image",
        metavar="IMAGE",
        help="base image (default: vllm/vllm-openai:v<release>)",
    )
    m.add_argument(
        "--tag", help="image reference (default: vllm-openai:v<release>-<local>)"
    )
    m.add_argument(
        "--wheel", metavar="FILE", help="the patched wheel (default: made in --out)"
    )
    m.set_defaults(force=False)
