"""The figures README.md and docs/ state about the tools' output, produced here by
running the tools: `dos-jax plan` on the H100 node preset (the split Auto chooses for
7B, 13B and 20B, and the step with early host calls) and the cost model's presets
against the paper's measured throughput (`experiments/bench_costmodel.py --paper`).

Each test computes the sentence from the tool's output and checks that the documents
say exactly that, so a change of the planner that moves a figure fails here until the
docs (and experiments/RESULTS.md, whose rows hold the same figures) are updated.
"""

import contextlib
import functools
import importlib.util
import io
import pathlib
import re

import pytest

from dos_jax import cli

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _doc(name: str) -> str:
  """The document's text with line breaks and indentation folded to single spaces."""
  return ' '.join((ROOT / name).read_text(encoding='utf-8').split())


@functools.cache
def _plan(model: str) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert cli.main(['plan', '--profile', 'h100-pcie5', '--model', model]) == 0
  return out.getvalue()


def _split(model: str) -> tuple[int, int, int]:
  """(subgroups per GPU, resident, streamed) of Auto's chosen plan."""
  text = _plan(model)
  total = int(re.search(r'(\d+) subgroups of [\d,]+ elements per device', text).group(1))
  chosen = re.search(r'^chosen plan: (.*)$', text, re.M).group(1)
  resident = int(re.match(r'(\d+)(?:/\d+)? subgroups resident', chosen).group(1))
  streamed = re.search(r'(\d+) subgroups streamed', chosen)
  return total, resident, int(streamed.group(1)) if streamed else 0


def split_sentence() -> str:
  (n7, r7, s7), (n13, r13, s13), (n20, r20, s20) = (_split(m) for m in ('7b', '13b', '20b'))
  assert (r7, s7, r13, s13) == (n7, 0, n13, 0), 'the sentence below says "all ... resident"'
  device = r20 + s20
  return (f'keeps all {n7} subgroups per GPU of 7B and all {n13} of 13B resident, and'
          f' updates {device} of {n20} ({round(100 * device / n20)}%) of 20B\'s on the'
          f' device ({r20} resident, {s20} streamed)')


def early_sentence() -> str:
  text = _plan('7b')
  line = re.search(r'^AllHost as the step runs it.*$', text, re.M).group(0)
  one = re.search(r'one host call after the backward pass ([\d,]+) ms', line).group(1)
  mean, gain = re.search(r'mean ([\d,]+) ms at a clip rate of 0\.1 \(([\d.]+)x\)',
                         line).groups()
  return f'AllHost: {one} ms -> {mean} ms mean, {gain}x'


def paper_sentence() -> str:
  spec = importlib.util.spec_from_file_location(
      'bench_costmodel', ROOT / 'experiments' / 'bench_costmodel.py')
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  with contextlib.redirect_stdout(io.StringIO()):
    rows = bench.paper_check()
  within = sum(abs(ours - paper) <= 0.15 * paper for *_, paper, ours in rows)
  return f'{within} of {len(rows)} cells within 15%'


@pytest.mark.parametrize('document', ['README.md', 'docs/planner.md'])
def test_the_split_auto_chooses_on_an_h100_node(document):
  sentence = split_sentence()
  assert sentence in _doc(document), f'{document} should say: {sentence}'


def test_the_early_host_calls_gain_for_7b():
  sentence = early_sentence()
  assert sentence in _doc('docs/planner.md'), f'docs/planner.md should say: {sentence}'


@pytest.mark.parametrize('document', ['README.md', 'docs/planner.md'])
def test_the_presets_against_the_papers_throughput(document):
  sentence = paper_sentence()
  assert sentence in _doc(document), f'{document} should say: {sentence}'


def test_results_md_rows_hold_the_same_figures():
  results = _doc('experiments/RESULTS.md')
  n20, r20, s20 = _split('20b')
  assert f'{r20} of {n20} resident, {s20} streamed' in results
  one, mean, gain = re.match(r'AllHost: (\S+) ms -> (\S+) ms mean, (\S+)x',
                             early_sentence()).groups()
  assert f'{one} ms -> {mean} ms ({gain}x)' in results
  within = paper_sentence().split(' cells')[0]
  assert f'{within} within 15%' in results


def test_results_md_is_one_page_and_every_link_to_a_row_lands():
  """RESULTS.md stays a page of current figures (the history is in experiments/notes/),
  and every `RESULTS.md#anchor` link in the README, CONTRIBUTING.md and docs/ names a
  row's anchor or a section heading there."""
  text = (ROOT / 'experiments' / 'RESULTS.md').read_text(encoding='utf-8')
  assert len(text.splitlines()) <= 400
  anchors = set(re.findall(r'<a id="([\w-]+)"></a>', text))
  anchors |= {re.sub(r'[^\w -]', '', h).strip().lower().replace(' ', '-')
              for h in re.findall(r'^#+ (.*)$', text, re.M)}
  documents = ['README.md', 'CONTRIBUTING.md', *sorted(
      str(p.relative_to(ROOT)) for p in (ROOT / 'docs').glob('*.md'))]
  for name in documents:
    for anchor in re.findall(r'RESULTS\.md#([\w-]+)', (ROOT / name).read_text(encoding='utf-8')):
      assert anchor in anchors, f'{name}: RESULTS.md#{anchor} names no row or section'
