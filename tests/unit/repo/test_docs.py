"""The docs: the generated references equal what the code gives now, every relative link of
README.md and docs/*.md names a file that exists (and a heading of it, for an anchor), and
the tables of ops (security.md's roles, internals.md's owners) list every registered op."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from kspeedfs import docgen
from kspeedfs.format.config import Settings
from kspeedfs.node.ops import OpRegistry
from kspeedfs.node.server import NodeServer

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and [text]: target, the target up to a space or ')'.
LINK = re.compile(r"\]\(([^)\s]+)[^)]*\)|^\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


@pytest.mark.parametrize("name", sorted(docgen.REFERENCES))
def test_generated_reference_is_up_to_date(name: str) -> None:
    committed = (ROOT / "docs" / name).read_text()
    assert committed == docgen.REFERENCES[name](), (
        f"docs/{name} is out of date with the code: run `{docgen.REGENERATE}` and commit it"
    )


def relative_links(page: Path) -> list[str]:
    """The page's links to files of the repository (their anchors dropped)."""
    return [path for path, _anchor in relative_targets(page) if path]


def relative_targets(page: Path) -> list[tuple[str, str]]:
    """(path, anchor) of every link that is not a URL; path "" for a link within the page."""
    out = []
    for target in (a or b for a, b in LINK.findall(page.read_text())):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # a URL
            path, _, anchor = target.partition("#")
            out.append((path, anchor))
    return out


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of the page's headings (outside code blocks)."""
    out, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_name_files_that_exist(page: Path) -> None:
    missing = [t for t in relative_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


# A test module named in prose (`tests/system/test_csi.py`, `tests/system/test_decoded_*.py`).
TEST_PATH = re.compile(r"(?<![\w/.])tests/[\w/*]+\.py")


def test_every_test_path_named_exists() -> None:
    """The docs, the package, the benches and the tests name test files that exist (they moved
    once, to tests/unit and tests/system)."""
    texts = [
        *PAGES,
        ROOT / "pyproject.toml",
        *(
            p
            for top in ("kspeedfs", "mountd", "pytorch_ext", "bench", "tests")
            for p in sorted((ROOT / top).rglob("*.py"))
        ),
        *sorted((ROOT / "kspeedfs").rglob("*.proto")),
    ]
    named = {(t, m) for t in texts for m in TEST_PATH.findall(t.read_text())}
    assert len(named) > 20, "the pattern finds the test paths the docs name"
    missing = sorted(f"{t.relative_to(ROOT)}: {m}" for t, m in named if not list(ROOT.glob(m)))
    assert not missing, f"named test files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_link_anchors_name_headings(page: Path) -> None:
    broken = [
        f"{path}#{anchor}"
        for path, anchor in relative_targets(page)
        if anchor
        and (page.parent / (path or page.name)).suffix == ".md"
        and anchor not in anchors(page.parent / (path or page.name))
    ]
    assert not broken, f"{page.relative_to(ROOT)} links to missing headings: {broken}"


def test_link_check_sees_links() -> None:
    # The check above passes trivially if the pattern finds nothing: it must see these.
    assert "docs/index.md" in relative_links(ROOT / "README.md")
    assert {"concepts.md", "cli.md", "settings.md"} <= set(relative_links(ROOT / "docs/index.md"))


def test_every_docs_page_is_in_the_index() -> None:
    listed = set(relative_links(ROOT / "docs" / "index.md"))
    pages = {p.name for p in PAGES if p.parent == ROOT / "docs" and p.name != "index.md"}
    assert pages <= listed, f"pages missing from docs/index.md: {sorted(pages - listed)}"


def test_benchmarks_lists_every_bench() -> None:
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    benches = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert benches, "no bench/*.py found"
    missing = [name for name in benches if f"bench/{name}`" not in page]
    assert not missing, f"docs/benchmarks.md leaves out {missing}"


def test_the_readme_links_the_index_for_its_page_list() -> None:
    """One page list, docs/index.md: the README's documentation section links it alone."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    links = [a or b for a, b in LINK.findall(section)]
    assert links == ["docs/index.md"], f"README.md's documentation section links {links}"


def default_lines(reference: str) -> dict[str, str]:
    """Setting -> what follows `- default:` in its section, up to the section's next item."""
    sections = re.findall(r"^### `(\w+)`\n(.*?)(?=^#{1,3} |\Z)", reference, re.M | re.S)
    out = {}
    for name, body in sections:
        found = re.search(r"^- default: (.*?)\n(?=- |\s*\Z)", body, re.M | re.S)
        out[name] = found.group(1) if found else ""
    return out


def test_settings_defaults_render_as_values() -> None:
    """Each default in docs/settings.md is the value a config file would hold, in code, or for
    one computed where it runs (a named function), one line saying how: never the docstring of
    the factory's type (`list`'s, once)."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    defaults = default_lines(docgen.settings_reference())
    assert sorted(defaults) == sorted(fields)
    for name, shown in defaults.items():
        factory = fields[name].default_factory
        computed = inspect.isfunction(factory) and factory.__name__ != "<lambda>"
        assert "\n" not in shown, f"settings.md: the default of {name} takes lines: {shown!r}"
        if not computed:
            assert re.fullmatch(r"`[^`]+`( \([^)]*\))?", shown), (
                f"settings.md: the default of {name} is not a value: {shown!r}"
            )
        else:
            assert shown, f"settings.md: {name} shows no default"


def test_default_check_sees_a_docstring_default() -> None:
    page = "### `a`\n\n- default: `[]`\n- accepts: x\n\n### `b`\n\n- default: Built-in.\n\nIf no\n"
    assert default_lines(page) == {"a": "`[]`", "b": "Built-in.\n\nIf no"}


def test_generator_names_an_undocumented_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new setting without its docstring line fails generation, naming it and the fix."""
    from kspeedfs.format import config

    @dataclasses.dataclass
    class More(config.Settings):
        brand_new: int = 0

    More.__doc__ = config.Settings.__doc__
    monkeypatch.setattr(config, "Settings", More)
    with pytest.raises(docgen.UndocumentedError, match="'brand_new' has no line"):
        docgen.settings_reference()


def test_internals_lists_the_layers_of_pyproject() -> None:
    """docs/internals.md writes out the layers contract; a changed contract fails here."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c["layers"] for c in contracts["contracts"] if c["type"] == "layers")
    page = (ROOT / "docs" / "internals.md").read_text()
    block = "```\n" + "\n".join(layers) + "\n```"
    assert block in page, f"docs/internals.md: write the layers of pyproject.toml as\n{block}"


def test_check_names_a_stale_file_and_the_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert docgen.main(["--write", "--docs", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 0
    (tmp_path / "settings.md").write_text("old\n")
    capsys.readouterr()
    assert docgen.main(["--check", "--docs", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "settings.md is out of date" in err and docgen.REGENERATE in err
    assert "cli.md" not in err


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> OpRegistry:
    """The ops of a node built with etcd (so the control plane's are there too); nothing is
    started and etcd is never reached."""
    tmp = tmp_path_factory.mktemp("ops")
    settings = Settings(
        shm_dir=tmp / "shm", token_file=tmp / "token", transport="tcp", etcd=["http://127.0.0.1:9"]
    )
    return NodeServer(settings).ops


def table_rows(page: Path, heading: str) -> list[list[str]]:
    """The cells of each row of the first table after `heading` (its header row and rule
    left out)."""
    lines = page.read_text().splitlines()
    start = lines.index(heading)
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def ops_named(cell: str) -> list[str]:
    """The op names of a cell: its code spans, outside parentheses (which may name others)."""
    return re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", cell))


def test_security_lists_every_op_with_its_registered_role(registry: OpRegistry) -> None:
    documented = {
        op: row[0].strip("`")
        for row in table_rows(ROOT / "docs" / "security.md", "## Roles")
        for op in ops_named(row[2])
    }
    registered = {name: registry.get(name).role for name in registry.names()}
    assert documented == registered, (
        "docs/security.md's roles table differs from the registry: "
        f"documented {sorted(documented.items() - registered.items())}, "
        f"registered {sorted(registered.items() - documented.items())}"
    )


def test_internals_lists_every_op_in_its_owners_row(registry: OpRegistry) -> None:
    """Each op in one row of docs/internals.md's owners table: the row of the module (or
    package) whose handler answers it."""
    rows = table_rows(ROOT / "docs" / "internals.md", "## The node daemon")
    where = {op: row[1].strip("`") for row in rows for op in ops_named(row[2])}
    assert sorted(where) == registry.names(), "docs/internals.md: an op missing or extra"
    for name in registry.names():
        source = Path(inspect.getfile(registry.get(name).handler)).resolve()
        module = source.relative_to(ROOT / "kspeedfs").as_posix()
        documented = where[name]
        assert module == documented or module.startswith(documented.rstrip("/") + "/"), (
            f"docs/internals.md: {name} is answered in {module}, not {documented}"
        )
