"""A config of configs/ to change and write elsewhere (bench and check scripts).

The shipped configs name their data files relative to their own folder; load() makes those
paths absolute, so that the copy a script writes into a temp folder reads the same files.
"""
import json
import os

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs")


def _absolute(path):
    joined = os.path.join(CONFIGS, path)
    return os.path.abspath(joined) if not os.path.isabs(path) and os.path.exists(joined) else path


def load(name):
    """configs/NAME parsed, each relative path of its data section that exists made absolute."""
    with open(os.path.join(CONFIGS, name)) as f:
        c = json.load(f)
    for key, value in c.get("data", {}).items():
        if isinstance(value, list):
            c["data"][key] = [_absolute(v) if isinstance(v, str) else v for v in value]
        elif isinstance(value, str):
            c["data"][key] = _absolute(value)
    return c
