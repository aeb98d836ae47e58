"""Will the carried wheels install on the device? Checked here, not hoped.

    python tools/gpu_check_wheels.py WHEELS [--same-as OTHER_WHEELS] [--data-only NAME ...]

Run by the Python of an environment that holds the device's preinstalled
package set (`tools/gpu_check.sh --rehearse` runs it in its device-like
environment). For every wheel in WHEELS (the cp312 folder the device gets):
its tags install on the device's CPython 3.12 / manylinux x86_64, its
Requires-Python admits 3.12, and every requirement, markers evaluated for
Python 3.12 on Linux (pip here would evaluate them for this interpreter),
is met by another wheel of the folder or by a distribution this
environment has (but a --data-only wheel's: installed with --no-deps, read
for its files, never imported). --same-as: the two folders hold the same distributions
(the rehearsal installs the host's twin of the folder); versions that differ
are named, not refused (megatron-core >= 0.17 requires Python 3.12, which
this machine's torch lacks). Exit 0, or 1 with one line per problem.
"""
from __future__ import annotations

import argparse
import sys
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.tags import compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

DEVICE_PYTHON = (3, 12)
# The device's glibc is unknown here beyond "manylinux": every policy up to 2_28 (the
# newest the carried wheels use) is accepted.
DEVICE_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                    "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
                    "manylinux_2_5_x86_64", "manylinux1_x86_64", "linux_x86_64"]


def device_tags() -> set:
    return set(cpython_tags(DEVICE_PYTHON, platforms=DEVICE_PLATFORMS)) | set(
        compatible_tags(DEVICE_PYTHON, "cp312", DEVICE_PLATFORMS))


def device_markers() -> dict:
    """This interpreter's marker environment, with the device's Python version."""
    return {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
            "implementation_version": "3.12.0", "sys_platform": "linux",
            "platform_system": "Linux", "platform_machine": "x86_64", "extra": ""}


def wheel_metadata(path: Path):
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(wheel.read(name).decode())


def folder(path: Path) -> dict:
    """{canonical name: (version, wheel path)} of a wheel folder."""
    wheels = {}
    for wheel in sorted(path.glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        wheels[name] = (version, wheel)
    return wheels


def installed() -> dict:
    """{canonical name: version} of what this environment has (the device's set)."""
    return {canonicalize_name(d.metadata["Name"]): Version(d.version)
            for d in metadata.distributions() if d.metadata["Name"]}


def problems_of(wheels: dict, present: dict, data_only: frozenset = frozenset()) -> list[str]:
    tags, markers = device_tags(), device_markers()
    available = {**present, **{name: version for name, (version, _) in wheels.items()}}
    problems = []
    for name, (version, path) in wheels.items():
        if not tags & set(parse_wheel_filename(path.name)[3]):
            problems.append(f"{path.name}: no tag installs on CPython 3.12 manylinux x86_64")
        meta = wheel_metadata(path)
        if not SpecifierSet(meta.get("Requires-Python") or "").contains("3.12.0"):
            problems.append(f"{path.name}: Requires-Python {meta['Requires-Python']}")
        for line in [] if name in data_only else meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(markers):
                continue
            have = available.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{name} {version} needs {req}: neither carried nor on the device")
            elif not req.specifier.contains(have, prereleases=True):
                problems.append(f"{name} {version} needs {req}: {req.name} {have} is there")
    return problems


def differences(wheels: dict, other: dict) -> tuple[list[str], list[str]]:
    """(problems: distributions in one folder only, notes: versions that differ)."""
    missing = [f"{name}: in {'the rehearsal' if name in other else 'the device'}'s folder only"
               for name in sorted(set(wheels) ^ set(other))]
    versions = [f"{name}: {wheels[name][0]} for the device, {other[name][0]} rehearsed"
                for name in sorted(set(wheels) & set(other)) if wheels[name][0] != other[name][0]]
    return missing, versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, help="the device's wheel folder (.gpu-wheels)")
    parser.add_argument("--same-as", type=Path, help="a folder that must hold the same names")
    parser.add_argument("--data-only", nargs="*", default=[],
                        help="wheels installed with --no-deps (their requirements not checked)")
    args = parser.parse_args()
    wheels = folder(args.wheels)
    problems = problems_of(wheels, installed(),
                           frozenset(canonicalize_name(n) for n in args.data_only))
    if args.same_as:
        missing, versions = differences(wheels, folder(args.same_as))
        problems += missing
        for note in versions:
            print(f"gpu_check_wheels: note: {note}")
    for problem in problems:
        print(f"gpu_check_wheels: {problem}")
    print(f"gpu_check_wheels: {len(wheels)} wheels in {args.wheels}: "
          f"{'all install on the device' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
