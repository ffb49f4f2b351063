"""The package's layers hold: no import cycle inside specjax/ (imports inside
functions included), and drafters import nothing from decoding/ or training/.

Read from the source (ast), so a cycle hidden in a function-level import is
found as surely as one at module level.
"""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specjax")


def _modules() -> dict:
  out = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(folder, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
  return out


def import_graph() -> dict:
  """module -> the specjax modules it imports (anywhere in its source)."""
  mods = _modules()
  graph = {m: set() for m in mods}
  for m, path in mods.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        graph[m] |= {a.name for a in node.names if a.name in mods}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module in mods:
          graph[m].add(node.module)
        graph[m] |= {f"{node.module}.{a.name}" for a in node.names
                     if f"{node.module}.{a.name}" in mods}
  return graph


def cycles(graph: dict) -> list:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1 or v in graph[v]:
        out.append(sorted(comp))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_no_import_cycle_in_specjax():
  assert cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():  # negative control
  assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_drafters_import_nothing_from_decoding_or_training():
  bad = sorted((m, t) for m, deps in import_graph().items() if m.startswith("specjax.drafters")
               for t in deps if t.startswith(("specjax.decoding", "specjax.training")))
  assert bad == []
