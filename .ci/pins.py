"""Check that the installed test and documentation tools are the versions constraints.txt pins.

    python .ci/pins.py dev classical faiss triton fast-cpu     # the extras `make test` uses

Walks rcdl's requirements for the named extras, and theirs in turn, through the installed
distributions; every package met on the way that constraints.txt pins must be installed at
exactly the pinned version. Prints each one that is not and exits 1, naming the command that
puts them right; exits 0 silently otherwise. ``--quiet`` prints nothing either way (for the
Makefile's decision to reinstall). Standard library and ``packaging`` (which pytest
brings) only.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"


def pins(path: Path = CONSTRAINTS) -> dict[str, str]:
    """``{canonical name: version}`` of every ``name==version`` line of ``path``."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            if not version:
                raise SystemExit(f"{path}: {line!r} is not of the form name==version")
            found[canonicalize_name(name)] = version.strip()
    return found


def _requirements(dist: str, extras: set[str]) -> list[Requirement]:
    """The requirements of the installed ``dist`` that apply with ``extras``."""
    wanted = []
    for text in metadata.requires(dist) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e})
                                     for e in extras | {""}):
            wanted.append(req)
    return wanted


def reached(extras: set[str]) -> dict[str, str]:
    """``{canonical name: installed version}`` of every installed distribution that rcdl
    with ``extras`` requires, directly or through another."""
    found: dict[str, str] = {}
    todo = [(req.name, set(req.extras)) for req in _requirements("rcdl", extras)]
    while todo:
        name, wanted = todo.pop()
        key = canonicalize_name(name)
        if key == "rcdl":  # an extra that names others (all = rcdl[...])
            todo += [(req.name, set(req.extras)) for req in _requirements("rcdl", wanted)]
            continue
        if key in found:
            continue
        try:
            found[key] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # not installed: pip says so when it matters
        todo += [(req.name, set(req.extras)) for req in _requirements(name, wanted)]
    return found


def main(argv: list[str]) -> int:
    quiet = "--quiet" in argv
    extras = {a for a in argv if not a.startswith("--")}
    try:
        installed = reached(extras)
    except metadata.PackageNotFoundError:
        if not quiet:
            print("pins: rcdl is not installed (run `make setup`)", file=sys.stderr)
        return 1
    pinned = pins()
    drift = sorted((name, have, pinned[name]) for name, have in installed.items()
                   if name in pinned and have != pinned[name])
    if drift and not quiet:
        print("pins: these tools differ from constraints.txt, so this machine would not run "
              "the tests CI runs:", file=sys.stderr)
        for name, have, want in drift:
            print(f"  {name} {have} installed, {want} pinned", file=sys.stderr)
        print(f"  put them right with: python -m pip install -c constraints.txt -e "
              f"'.[{','.join(sorted(extras))}]'   (or rm .setup-stamp && make setup)",
              file=sys.stderr)
    return 1 if drift else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
