"""Counts a pytest run's skips by reason (its --junitxml report) and fails on one whose
reason no line of the allow-list matches.

Usage: python3 .ci/check_skips.py REPORT.xml ALLOWED.txt STAGE
ALLOWED.txt: one fnmatch pattern of a skip reason a line ('#' starts a comment); an
empty file allows none, `-` allows every reason (the skips are only counted). Exit 0 when every skip is allowed, 1 otherwise (naming each).
"""

import ast
import collections
import fnmatch
import sys
import xml.etree.ElementTree as ET


def main(argv: list[str]) -> int:
  report, allowed_path, stage = argv
  if allowed_path == '-':
    allowed = ['*']
  else:
    with open(allowed_path, encoding='utf-8') as f:
      allowed = [line.strip() for line in f
                 if line.strip() and not line.lstrip().startswith('#')]
  counts = collections.Counter()
  tests = 0
  for case in ET.parse(report).getroot().iter('testcase'):
    tests += 1
    for skipped in case.findall('skipped'):
      if skipped.get('type') == 'pytest.xfail':
        continue
      reason = (skipped.get('message') or '').strip()
      if reason == 'collection skipped':  # a module skipped at import: (file, line, reason)
        try:
          reason = str(ast.literal_eval((skipped.text or '').strip())[2])
        except (ValueError, SyntaxError, IndexError, TypeError):
          reason = (skipped.text or reason).strip()
        reason = reason.removeprefix('Skipped: ')
      counts[reason] += 1
  print(f'ci: {stage}: {tests} tests, {sum(counts.values())} skipped')
  unknown = []
  for reason, n in sorted(counts.items(), key=lambda kv: -kv[1]):
    ok = any(fnmatch.fnmatchcase(reason, pattern) for pattern in allowed)
    print(f'ci: {stage}:   {n:4d} skipped: {reason}' + ('' if ok else '  <- not in ' + allowed_path))
    if not ok:
      unknown.append(reason)
  if unknown:
    print(f'ci: {stage}: {len(unknown)} skip reason(s) not in {allowed_path}; a test that '
          'should run was skipped (add the reason there only if the skip is expected)')
    return 1
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
