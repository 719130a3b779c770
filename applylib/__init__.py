"""apply.py's library: see apply.py and README.md (Layout)."""
