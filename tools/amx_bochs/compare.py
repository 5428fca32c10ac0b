#!/usr/bin/env python3
"""Reads the harness's output from Bochs (AMX against SoftTiles inside the emulated CPU) and,
where given, from the host builds (SoftTiles on the host CPU), and says whether anything is
wrong. Exit status 0 when nothing is.

Usage: compare.py BOCHS_OUTPUT [HOST_OUTPUT [HOST_PLAIN_OUTPUT]]

Wrong: the guest did not reach END, faulted, hit a stub, or found its start-up block unequal;
a case whose AMX and SoftTiles outputs differ other than NaN against NaN (NaN payloads and
signs are not modelled; README.md); a case whose SoftTiles hash differs from the host's.
"""
import re
import sys
from dataclasses import dataclass

CASE_LINE = re.compile(
    r"CASE (?P<name>\S+) n=(?P<n>\d+) diff=(?P<diff>\d+) soft=(?P<soft>[0-9a-f]+)"
    r"(?: soft_nans_merged=(?P<soft_merged>[0-9a-f]+))?"
    r"(?: amx=(?P<amx>[0-9a-f]+))? (?P<verdict>EQUAL|DIFFER)(?: non_nan_diff=(?P<non_nan>\d+))?")
# Lines the guest prints about itself, shown as they are.
GUEST_LINES = ("EXCEPTION", "STUB", "FATAL", "SUMMARY", "cpu_has", "startup")
# Cases only the guest runs: they need the real instructions (ldtilecfg, sttilecfg).
GUEST_ONLY = re.compile(r"config-")


@dataclass
class Case:
    n: int
    diff: int
    soft: str
    soft_nans_merged: str  # (absent from outputs of older harnesses)
    amx: str
    non_nan_diff: int


def read_cases(path: str) -> tuple:
    with open(path, errors="replace") as f:
        text = f.read()
    cases = {}
    for m in CASE_LINE.finditer(text):
        cases[m["name"]] = Case(int(m["n"]), int(m["diff"]), m["soft"],
                                m["soft_merged"] or m["soft"], m["amx"] or "",
                                int(m["non_nan"] or 0))
    return text, cases


def compare_with_host(label: str, guest: dict, path: str, nans_merged: bool,
                      problems: list) -> None:
    _, host = read_cases(path)
    common = [name for name in guest if name in host]

    def key(case: Case) -> str:
        return case.soft_nans_merged if nans_merged else case.soft

    differ = [name for name in common if key(guest[name]) != key(host[name])]
    missing = [name for name in guest if name not in host and not GUEST_ONLY.match(name)]
    nans = ", NaNs merged" if nans_merged else ""
    print(f"SoftTiles in Bochs vs host ({label}{nans}): {len(common) - len(differ)} equal "
          f"hashes, {len(differ)} differ {differ}")
    if differ:
        problems.append(f"SoftTiles hashes differ from the host's ({label}): {differ}")
    if missing:
        problems.append(f"cases missing from the host's output ({label}): {missing}")


def main() -> int:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    text, guest = read_cases(sys.argv[1])
    problems = []
    for line in text.splitlines():
        if line.startswith(GUEST_LINES):
            print("bochs:", line)
    if "\nEND" not in text:
        problems.append("the Bochs run did not reach END")
    if re.search(r"^(EXCEPTION|STUB|FATAL)", text, re.M):
        problems.append("the guest stopped on a fault, a stub or a fatal error")
    if "kAmxGranted" not in text:
        problems.append("the start-up block (cpu_amx_check.cpp) did not grant AMX")

    equal = [name for name, case in guest.items() if case.diff == 0]
    print(f"cases: {len(guest)}, AMX == SoftTiles bit for bit: {len(equal)}, "
          f"differing: {len(guest) - len(equal)}")
    for name, case in guest.items():
        if case.diff == 0:
            continue
        kind = "all NaN against NaN" if case.non_nan_diff == 0 else \
            f"{case.non_nan_diff} not NaN against NaN"
        print(f"  DIFFER {name}: {case.diff} of {case.n} outputs, {kind}")
        if case.non_nan_diff:
            problems.append(f"{name}: AMX and SoftTiles differ beyond NaN payloads")

    # The host build with the harness's flags has the guest's code generation: same bits,
    # NaNs included. With plain -O2 the compiler may order a NaN's operands otherwise.
    hosts = [("harness flags", False), ("plain -O2", True)]
    for (label, nans_merged), path in zip(hosts, sys.argv[2:]):
        compare_with_host(label, guest, path, nans_merged, problems)
    if len(sys.argv) > 2:
        _, host = read_cases(sys.argv[2])
        with_amx = [name for name in guest if name in host and guest[name].amx]
        amx_differ = [name for name in with_amx if guest[name].amx != host[name].soft]
        print(f"AMX in Bochs vs host SoftTiles: {len(with_amx) - len(amx_differ)} equal, "
              f"differ: {amx_differ}")
    else:
        print("no host output (the host lacks AVX-512 BF16?): Bochs's SoftTiles not checked "
              "against a real CPU's")

    for problem in problems:
        print("PROBLEM:", problem)
    print("RESULT:", "FAIL" if problems else "PASS")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
