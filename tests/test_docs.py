"""The docs say what is so: every test a doc names exists, a sentence that says a test runs
"in CI" names no test CI leaves out, and every figure of the README's "Headline figures" is
in the newest entry of the docs/benchmarks.md section it links to.

Pure text: test files are read with ``ast`` (never imported), ``.ci/run`` and
``pyproject.toml`` are read for the marker expressions CI's pytest runs select."""

from __future__ import annotations

import ast
import re
import shlex
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# `tests/a/test_b.py`, `tests/a/test_b.py::test_c`, `test_b.py::test_c`, `…::test_c`
PATH_REF = re.compile(r"(?<![\w/.])((?:tests/[\w/]*?)?test_\w+\.py)(?:::(\w+))?")
ELLIPSIS_REF = re.compile(r"(?:…|\.\.\.)::(\w+)")
NAME_REF = re.compile(r"(?<![\w/.:])(test_\w+)(?![\w.]|::)")
DATE = re.compile(r"\b(20\d\d-\d\d-\d\d)\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b")
NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


class ParsedTests:
    """What a test file defines, read from its syntax tree: its test functions and test
    methods (by name), and the marks each carries (decorators' ``pytest.mark.<name>``
    and the module's ``pytestmark``)."""

    def __init__(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), filename=str(path))
        self.path = path
        self.module_marks = set()
        self.marks: dict[str, set[str]] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
                self.module_marks |= _marks_in(node.value)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.marks[node.name] = _marks_of(node)
            elif isinstance(node, ast.ClassDef):
                self.marks[node.name] = _marks_of(node)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.marks[item.name] = _marks_of(node) | _marks_of(item)

    def marks_of(self, name: str) -> set[str]:
        return self.module_marks | self.marks[name]


def _marks_in(node: ast.AST) -> set[str]:
    """``pytest.mark.<name>`` anywhere in an expression (a decorator, a list of them)."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"}


def _marks_of(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
    marks = set()
    for decorator in node.decorator_list:
        # skipif/xfail carry a condition: only an unconditional skip is always left out
        marks |= _marks_in(decorator.func if isinstance(decorator, ast.Call) else decorator)
    return marks


@cache
def parsed_tests() -> dict[str, ParsedTests]:
    """Every ``test_*.py`` under tests/, by its path relative to the repository."""
    return {str(p.relative_to(ROOT)): ParsedTests(p) for p in sorted(TESTS.rglob("test_*.py"))}


def resolve(path: str) -> list[str]:
    """The test files a doc's path means: ``tests/...`` exactly, a bare file name by name."""
    if path.startswith("tests/"):
        return [path] if path in parsed_tests() else []
    return [p for p in parsed_tests() if p.endswith("/" + path)]


def references(text: str) -> list[tuple[str | None, str | None, str]]:
    """(file, test name, what the doc wrote) for every test reference in ``text``: a path
    with or without ``::name``, ``…::name`` (the file named last before it), a bare name
    outside code blocks."""
    refs: list[tuple[int, str | None, str | None, str]] = []
    last_file = None
    events = sorted([(m.start(), "path", m) for m in PATH_REF.finditer(text)]
                    + [(m.start(), "ellipsis", m) for m in ELLIPSIS_REF.finditer(text)])
    for _, kind, m in events:
        if kind == "path":
            last_file = m.group(1)
            refs.append((m.start(), m.group(1), m.group(2), m.group(0)))
        else:
            refs.append((m.start(), last_file, m.group(1), m.group(0)))
    covered = [range(m.start(), m.end()) for m in PATH_REF.finditer(text)]
    prose = re.sub(r"```.*?```", lambda m: " " * len(m.group()), text, flags=re.S)
    for m in NAME_REF.finditer(prose):  # a bare name in a code block is a variable
        if not any(m.start() in span for span in covered):
            refs.append((m.start(), None, m.group(1), m.group(0)))
    return [(f, n, s) for _, f, n, s in sorted(refs, key=lambda r: r[0])]


def located(file: str | None, name: str | None) -> list[tuple[str, str | None]]:
    """(test file, name) pairs a reference can mean; empty when it names nothing there."""
    if file is not None:
        return [(p, name) for p in resolve(file)
                if name is None or name in parsed_tests()[p].marks]
    stems = [p for p in parsed_tests() if Path(p).stem == name]
    if stems:
        return [(p, None) for p in stems]
    return [(p, name) for p, t in parsed_tests().items() if name in t.marks]


def test_every_test_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        for file, name, written in references(doc.read_text()):
            if not located(file, name):
                missing.append(f"{doc.relative_to(ROOT)}: {written}"
                               + (f" (in {file})" if file and name else ""))
    assert not missing, "docs name tests that do not exist:\n" + "\n".join(missing)


# --- "in CI" ---------------------------------------------------------------------------

def _pytest_invocations(script: str) -> list[list[str]]:
    """The argument lists of the pytest commands a shell script runs (continuations
    joined, comments dropped)."""
    lines = script.replace("\\\n", " ").splitlines()
    runs = []
    for line in lines:
        line = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        for command in re.split(r"&&|\|\||;", line):
            words = shlex.split(command)
            if "pytest" in words:
                runs.append(words[words.index("pytest") + 1:])
    return runs


def _marker_expression(args: list[str], default: str) -> str:
    """The ``-m`` expression of one pytest invocation (the last wins, as in pytest)."""
    expression = default
    for i, word in enumerate(args):
        if word == "-m" and i + 1 < len(args):
            expression = args[i + 1]
        elif word.startswith("-m") and len(word) > 2:
            expression = word[2:]
    return expression


def selects(expression: str, marks: set[str]) -> bool:
    """Whether a pytest ``-m`` expression (names, ``not``, ``and``, ``or``, parentheses)
    selects a test carrying ``marks``; the empty expression selects everything."""
    if not expression.strip():
        return True
    tokens = re.findall(r"\(|\)|[\w.-]+", expression)
    words = [t if t in ("(", ")", "not", "and", "or") else str(t in marks) for t in tokens]
    tree = ast.parse(" ".join(words), mode="eval")
    allowed = (ast.Expression, ast.BoolOp, ast.UnaryOp, ast.Not, ast.And, ast.Or,
               ast.Constant)
    assert all(isinstance(n, allowed) for n in ast.walk(tree)), expression
    return bool(eval(compile(tree, "<marker expression>", "eval"), {"__builtins__": {}}))


@cache
def ci_expressions() -> list[str]:
    """The marker expression of every pytest run in ``.ci/run``; pyproject's ``addopts``
    gives the default where a run passes no ``-m``."""
    found = re.search(r'^addopts\s*=\s*"((?:[^"\\]|\\.)*)"', (ROOT / "pyproject.toml").read_text(),
                      re.M)
    addopts = found.group(1).replace('\\"', '"') if found else ""
    default = _marker_expression(shlex.split(addopts), "")
    runs = _pytest_invocations((ROOT / ".ci" / "run").read_text())
    assert runs, ".ci/run runs no pytest"
    return [_marker_expression(args, default) for args in runs]


def ci_runs(marks: set[str]) -> bool:
    return "skip" not in marks and any(selects(e, marks) for e in ci_expressions())


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; each table row is a block of its own."""
    blocks = []
    for block in re.split(r"\n\s*\n", text):
        rows = block.splitlines()
        if rows and all(r.lstrip().startswith("|") for r in rows):
            blocks.extend(rows)
        else:
            blocks.append(block)
    return blocks


def test_a_doc_that_says_in_ci_names_no_test_ci_leaves_out():
    left_out = []
    for doc in DOCS:
        for block in paragraphs(doc.read_text()):
            if not re.search(r"\bin CI\b", block):
                continue
            for file, name, written in references(block):
                for path, test in located(file, name):
                    tests = [test] if test else list(parsed_tests()[path].marks)
                    for t in tests:
                        if t.startswith("test") and not ci_runs(parsed_tests()[path].marks_of(t)):
                            left_out.append(f"{doc.relative_to(ROOT)}: {written} ({path}::{t})")
    assert not left_out, ("a block that says 'in CI' names tests CI does not run "
                          f"(CI's marker expressions: {ci_expressions()}):\n"
                          + "\n".join(left_out))


def test_the_marker_expressions_select_as_pytest_does():
    assert selects("not slow", set()) and not selects("not slow", {"slow"})
    assert selects("slow", {"slow"}) and not selects("slow", {"parametrize"})
    assert selects("", {"slow"}) and selects("(a or b) and not c", {"b"})
    assert not selects("(a or b) and not c", {"a", "c"})


def test_references_read_paths_ids_continuations_and_names():
    text = ("`tests/ops/x/test_a.py::test_one`, `…::test_two` and `test_three`; "
            "`test_b.py::test_four`, all of `tests/test_c.py`.")
    a = "tests/ops/x/test_a.py"
    assert references(text) == [(a, "test_one", a + "::test_one"),
                                (a, "test_two", "…::test_two"),
                                (None, "test_three", "test_three"),
                                ("test_b.py", "test_four", "test_b.py::test_four"),
                                ("tests/test_c.py", None, "tests/test_c.py")]


# --- headline figures ------------------------------------------------------------------

def section(text: str, heading: str) -> str:
    """The lines after ``## heading`` up to the next ``## ``."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def benchmark_entries(anchor: str) -> list[str]:
    """The entries of the docs/benchmarks.md section ``<a id="anchor">``, in file order:
    one per ``### `` heading, or where a section has none, one per ``- Recorded at:``."""
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    match = re.search(rf'<a id="{re.escape(anchor)}"></a>\n## [^\n]*\n(.*?)(?=^<a id=|\Z)',
                      text, re.M | re.S)
    assert match, f"docs/benchmarks.md has no section #{anchor}"
    body = match.group(1)
    splitter = r"^(?=### )" if re.search(r"^### ", body, re.M) else r"^(?=- Recorded at:)"
    return [e for e in re.split(splitter, body, flags=re.M) if DATE.search(e)]


def newest(anchor: str) -> str:
    """An entry's date is the first date it states (its heading or its "Recorded at");
    entries are newest-first, so the first is the newest, and none after it is later."""
    entries = benchmark_entries(anchor)
    dates = [DATE.search(e).group(1) for e in entries]
    assert dates == sorted(dates, reverse=True), f"#{anchor}: entries not newest-first: {dates}"
    return entries[0]


def figures(text: str) -> set[str]:
    """The numbers a text states, dates, commits and link targets aside, signs dropped."""
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = COMMIT.sub(" ", DATE.sub(" ", text))
    return {n.replace(",", "") for n in NUMBER.findall(text)}


def headline_bullets() -> list[str]:
    """The bullets of the README's "Headline figures", each up to the next bullet or the
    first blank line."""
    body = section((ROOT / "README.md").read_text(), "Headline figures")
    bullets = re.split(r"^(?=- )", body, flags=re.M)
    return [b.split("\n\n")[0] for b in bullets if b.startswith("- ")]


def test_every_headline_figure_is_its_newest_benchmark_entrys():
    bullets = headline_bullets()
    assert len(bullets) >= 5, "the README's headline figures section has lost its list"
    wrong = []
    for bullet in bullets:
        anchors = re.findall(r"\(docs/benchmarks\.md#([\w-]+)\)", bullet)
        assert len(anchors) == 1, f"a headline links to one benchmarks entry: {bullet}"
        entry = newest(anchors[0])
        missing = figures(bullet) - figures(entry)
        stated = set(DATE.findall(bullet)) | set(COMMIT.findall(bullet))
        missing |= {s for s in stated if s not in entry}
        if missing:
            wrong.append(f"#{anchors[0]}: {sorted(missing)} not in its newest entry "
                         f"({DATE.search(entry).group(1)})")
    assert not wrong, "README headline figures that are not their newest entry's:\n" + \
        "\n".join(wrong)


def test_the_readme_states_no_suite_times():
    """Suite durations and counts change at every stop: they live in docs/benchmarks.md."""
    readme = (ROOT / "README.md").read_text()
    assert not re.search(r"\d+ min \d+ s|\d+ (?:quick |slow )?tests\b", readme)
    assert benchmark_entries("suite-times")
