#!/usr/bin/env python3
"""Checks the relative links in README.md and docs/*.md.

Every link to a file must name one that exists, and every #anchor a heading
of its target, slugged as GitHub does (lower case, spaces to '-', punctuation
dropped, '-1', '-2', ... for repeats). Links inside code are ignored.
Run from anywhere: hack/check-doc-links.py. Exits 1 on a broken link.
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text):
    """text with fenced code blocks and inline code blanked, newlines kept."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        out.append("" if fenced else line)
    text = "\n".join(out)
    return re.sub(r"`[^`]*`", lambda m: "\n" * m.group().count("\n"), text)


def slug(heading):
    s = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
    return s.replace(" ", "-")


def anchors(path):
    seen, out = {}, set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*)", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def main():
    bad = 0
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = prose(md.read_text())
        for m in LINK.finditer(text):
            target = m.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (md.parent / file).resolve() if file else md
            line = text.count("\n", 0, m.start()) + 1
            where = f"{md.relative_to(ROOT)}:{line}: {target}"
            if not dest.exists():
                print(f"{where}: no such file")
                bad += 1
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                print(f"{where}: no heading #{anchor}")
                bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
