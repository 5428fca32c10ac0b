#!/usr/bin/env python3
"""Applies the four Bochs fixes the AMX check needs (README.md, "The four Bochs fixes") to a
Bochs source tree, in place.

Usage: bochs_fixes.py BOCHS_SRC   (the folder that holds Bochs's configure script)

Each fix is a regular expression replaced inside one function of one file. The expression must
match exactly once there, or the fix must already be in place (a second run changes nothing);
anything else stops with an error, because an upstream change near these lines means the fix
has to be looked at again by a person, not guessed.
"""
import pathlib
import re
import sys
from dataclasses import dataclass


@dataclass
class Edit:
    pattern: str      # regular expression for the faulty code
    replacement: str  # re.sub replacement
    fixed: str        # regular expression that matches once the edit is in place


@dataclass
class Fix:
    title: str
    path: str         # relative to BOCHS_SRC
    scope: str        # regular expression for the start of the region the edits must fall in
    edits: list


# The region a fix may touch: from its scope's match to the end of that function (the first
# closing brace in column 0), so that a pattern cannot land on a look-alike elsewhere.
def region(text: str, fix: Fix) -> tuple:
    starts = [m.start() for m in re.finditer(fix.scope, text)]
    if len(starts) != 1:
        sys.exit(f"{fix.path}: {len(starts)} matches for scope {fix.scope!r}, want 1")
    end = text.find("\n}", starts[0])
    return starts[0], len(text) if end < 0 else end


FIXES = [
    Fix(
        "sttilecfg decodes with VEX.W0 (SDM: VEX.128.66.0F38.W0 49 /0)",
        "cpu/decoder/fetchdecode_opmap_avx.cc",
        r"BxOpcodeGroup_VEX_0F3849\[\]",
        [Edit(r"ATTR_VEX_W1(?=[^\n]*BX_IA_STTILECFG\))", "ATTR_VEX_W0",
              r"ATTR_VEX_W0(?=[^\n]*BX_IA_STTILECFG\))")],
    ),
    Fix(
        "sttilecfg/xsave store colsb (16 bits at 16 + 2n) and rows (a byte at 48 + n)",
        "cpu/xsave.cc",
        r"void BX_CPU_C::xsave_tilecfg_state\(",
        [
            Edit(r"(vmm16u\(8\+n\)\s*=\s*BX_CPU_THIS_PTR amx->tilecfg\[n\]\.)rows;",
                 r"\1bytes_per_row;",
                 r"vmm16u\(8\+n\)\s*=\s*BX_CPU_THIS_PTR amx->tilecfg\[n\]\.bytes_per_row;"),
            Edit(r"(vmmubyte\(48\+n\)\s*=\s*BX_CPU_THIS_PTR amx->tilecfg\[n\]\.)bytes_per_row;",
                 r"\1rows;",
                 r"vmmubyte\(48\+n\)\s*=\s*BX_CPU_THIS_PTR amx->tilecfg\[n\]\.rows;"),
        ],
    ),
    Fix(
        "a difference of equal-exponent floats that is normal (exponent 1) is not flushed",
        "cpu/softfloat3e/s_subMagsF32.cc",
        r"float32 softfloat_subMagsF32\(",
        [Edit(r"if \(!expZ && sigDiff\) \{",
              "if (!expZ && sigDiff && !((sigDiff << shiftDist) & 0x00800000)) {"
              "  // amx_bochs: bit 23 set is exponent 1, normal",
              r"if \(!expZ && sigDiff && !\(\(sigDiff << shiftDist\) & 0x00800000\)\) \{")],
    ),
    Fix(
        "vcvtne2ps2bf16's upper half converts src1's elements 0.. (SDM: src1.fp32[i - KL/2])",
        "cpu/avx/avx512_bf16.cc",
        r"void BX_CPP_AttrRegparmN\(1\) BX_CPU_C::VCVTNE2PS2BF16_MASK_VphHpsWpsR\(",
        [Edit(r"(for \(;\s*n < WORD_ELEMENTS\(len\);\s*n\+\+\)\s*"
              r"dst\.vmm16u\(n\) = convert_ne_fp32_to_bfloat16\()op1\.vmm32u\(n\)\)",
              r"\1op1.vmm32u(n - DWORD_ELEMENTS(len)))",
              r"op1\.vmm32u\(n - DWORD_ELEMENTS\(len\)\)")],
    ),
]


def apply(src: pathlib.Path, fix: Fix) -> str:
    path = src / fix.path
    if not path.is_file():
        sys.exit(f"{path}: not found (is {src} Bochs's source folder, with configure?)")
    text = path.read_text()
    begin, end = region(text, fix)
    body = text[begin:end]
    states = []
    for edit in fix.edits:
        faulty = len(re.findall(edit.pattern, body))
        done = len(re.findall(edit.fixed, body))
        if faulty == 1 and done == 0:
            body = re.sub(edit.pattern, edit.replacement, body)
            states.append("applied")
        elif faulty == 0 and done == 1:
            states.append("already in place")
        else:
            sys.exit(f"{fix.path}: {faulty} matches for {edit.pattern!r} and {done} for the "
                     f"fixed form, want 1 and 0 (or 0 and 1): the source changed here, "
                     f"look again at the fix \"{fix.title}\"")
    path.write_text(text[:begin] + body + text[end:])
    return ", ".join(sorted(set(states)))


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    src = pathlib.Path(sys.argv[1])
    for number, fix in enumerate(FIXES, 1):
        print(f"fix {number} ({fix.path}): {apply(src, fix)}: {fix.title}")


if __name__ == "__main__":
    main()
