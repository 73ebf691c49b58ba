#!/usr/bin/env python3
"""Extracts README.md's code blocks for the tests in readme/BUILD.bazel.

  readme_blocks.py cc README.md OUT_1.cc ... OUT_N.cc
      Writes the README's ```c++ blocks, in order, one per file, each
      preceded by a #line directive so that a compiler error names README.md
      and its line. Fails unless the README has exactly N such blocks.

  readme_blocks.py sh README.md
      Prints, for readme_sh_test.sh to source, the README's ```sh examples as
      commands in order: `readme_run LINE COMMAND` for each command (lines
      continued with a backslash joined, comment and blank lines left out),
      `readme_run LINE COMMAND STATUS` for one that must exit with STATUS,
      `readme_skip LINE COMMAND REASON` for one that is not run, and
      `readme_file NAME CONTENT` for a block the examples read as a file.

Markers: an HTML comment (invisible on the rendered page) on the line, or the
lines, right before a block's opening fence:

  <!-- readme-test: skip: REASON -->
      the block is not run; REASON is printed in the test's log.
  <!-- readme-test: skip lines with "TEXT": REASON -->
      the block's commands that contain TEXT are not run (REASON printed).
  <!-- readme-test: exit N from lines with "TEXT" -->
      the block's commands that contain TEXT must exit with status N (an
      example of an error).
  <!-- readme-test: file NAME -->
      on a block of another language: written as NAME into the scratch
      directory before the first command runs.

Commands with --backend=nccl (they need a GPU per rank) and `bazel test`
(the test suite, which runs this test) are never run.
"""

import re
import shlex
import sys

FENCE = re.compile(r"^```\s*([A-Za-z0-9_+-]*)\s*$")
MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")
SKIP_BLOCK = re.compile(r"^skip:\s*(\S.*)$")
SKIP_LINES = re.compile(r'^skip lines with "([^"]+)":\s*(\S.*)$')
FILE = re.compile(r"^file\s+([A-Za-z0-9_.-]+)$")
EXIT = re.compile(r'^exit (\d+) from lines with "([^"]+)"$')

# Per-command rules that hold for every block: (text, reason).
BUILTIN_SKIPS = [
    ("--backend=nccl", "needs one GPU per rank (NCCL); CI machines have none"),
    ("bazel test", "the test suite, which runs this test"),
]


class ReadmeError(Exception):
  pass


def parse_blocks(text):
  """Returns [(lang, first_content_line, lines, markers)] in README order."""
  lines = text.split("\n")
  blocks = []
  i = 0
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      if (lines[i].lstrip().startswith("<!--") and "readme-test" in lines[i]
          and not MARKER.match(lines[i])):
        raise ReadmeError(f"README.md:{i + 1}: malformed readme-test marker "
                          "(want <!-- readme-test: ... --> on a line of its "
                          "own)")
      i += 1
      continue
    lang = m.group(1)
    # The markers: the comment lines right above the fence.
    markers = []
    j = i - 1
    while j >= 0 and MARKER.match(lines[j]):
      markers.insert(0, (j + 1, MARKER.match(lines[j]).group(1)))
      j -= 1
    start = i + 1
    i += 1
    body = []
    while i < len(lines) and not lines[i].startswith("```"):
      body.append(lines[i])
      i += 1
    if i == len(lines):
      raise ReadmeError(f"README.md:{start}: ```{lang} block never closed")
    i += 1  # the closing fence
    blocks.append((lang, start + 1, body, markers))
  return blocks


def write_cc(readme, outs):
  blocks = [b for b in parse_blocks(readme) if b[0] in ("c++", "cpp", "cc")]
  if len(blocks) != len(outs):
    raise ReadmeError(
        f"README.md has {len(blocks)} ```c++ blocks (at lines "
        f"{', '.join(str(b[1]) for b in blocks)}) but readme/BUILD.bazel's "
        f"readme_snippets genrule lists {len(outs)} outputs: make them agree "
        "(one snippet_N.cc per block, in order)")
  for (_, first, body, _), out in zip(blocks, outs):
    with open(out, "w") as f:
      f.write(f"// Generated from README.md by readme/readme_blocks.py.\n")
      f.write(f'#line {first} "README.md"\n')
      f.write("\n".join(body) + "\n")


def commands(body, first):
  """Joins continued lines; yields (line, command) without comments."""
  pending, pending_line = None, None
  for n, line in enumerate(body, start=first):
    if pending is None:
      if not line.strip() or line.lstrip().startswith("#"):
        continue
      pending, pending_line = "", n
    if line.endswith("\\"):
      pending += line[:-1]
      continue
    pending += line
    yield pending_line, pending
    pending = None
  if pending is not None:
    raise ReadmeError(f"README.md:{pending_line}: command ends in a backslash "
                      "with no line after it")


def emit_sh(readme):
  out = []
  q = shlex.quote
  for lang, first, body, markers in parse_blocks(readme):
    block_skip, line_skips, file_name = None, list(BUILTIN_SKIPS), None
    exits = []
    for line, marker in markers:
      if m := SKIP_BLOCK.match(marker):
        block_skip = m.group(1)
      elif m := SKIP_LINES.match(marker):
        line_skips.append((m.group(1), m.group(2)))
      elif m := FILE.match(marker):
        file_name = m.group(1)
      elif m := EXIT.match(marker):
        exits.append((m.group(2), int(m.group(1))))
      else:
        raise ReadmeError(f"README.md:{line}: unknown readme-test marker "
                          f"{marker!r} (see readme/readme_blocks.py)")
    if file_name is not None:
      if lang == "sh":
        raise ReadmeError(f"README.md:{first - 1}: a file marker on a ```sh "
                          "block")
      out.append(f"readme_file {q(file_name)} {q(chr(10).join(body) + chr(10))}")
      continue
    if lang != "sh":
      if markers:
        raise ReadmeError(f"README.md:{markers[0][0]}: a readme-test marker "
                          f"on a ```{lang} block (only ```sh blocks run)")
      continue
    for line, command in commands(body, first):
      reason = block_skip
      for text, why in line_skips:
        if reason is None and text in command:
          reason = why
      if reason is not None:
        out.append(f"readme_skip {line} {q(command)} {q(reason)}")
      else:
        status = 0
        for text, code in exits:
          if text in command:
            status = code
        out.append(f"readme_run {line} {q(command)} {status}")
  print("\n".join(out))


def main(argv):
  if len(argv) < 3 or argv[1] not in ("cc", "sh"):
    print(__doc__, file=sys.stderr)
    return 2
  with open(argv[2]) as f:
    readme = f.read()
  try:
    if argv[1] == "cc":
      write_cc(readme, argv[3:])
    else:
      emit_sh(readme)
  except ReadmeError as e:
    print(f"readme_blocks.py: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
