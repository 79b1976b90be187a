"""The documentation harness catches what it exists to catch: a failing example, a stale option."""

from __future__ import annotations

from examples import ROOT, blocks, check_command, run_page, shell_commands


def test_a_failing_block_fails_with_its_page_line_and_stops_the_page(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n```python\ny = x / 0\n```\n\n```python\nz = 1\n```\n")
    (tmp_path / "cwd").mkdir()
    failure, skipped = run_page(page, tmp_path / "cwd")
    assert failure is not None and "page.md:8: ZeroDivisionError" in failure and skipped == []


def test_a_page_runs_in_a_fresh_interpreter(tmp_path):
    """What the test process imported is not there: a page must import what it uses."""
    import mhla_diffusers.autoencoder  # noqa: F401  (imported here, in the test process)

    page = tmp_path / "page.md"
    page.write_text("```python\nimport sys\nassert 'mhla_diffusers.autoencoder' not in sys.modules\n```\n")
    (tmp_path / "cwd").mkdir()
    assert run_page(page, tmp_path / "cwd") == (None, [])


def test_not_run_blocks_are_reported_with_their_reason(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\n# not run: needs a GPU\nimport nothing_here\n```\n")
    (tmp_path / "cwd").mkdir()
    assert run_page(page, tmp_path / "cwd") == (None, [(1, "needs a GPU")])


def test_a_stale_option_and_an_unknown_target_are_named(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```bash\npython conversion/convert.py --family dit --src a --out b --num-block 16\nmake tset\n```\n")
    problems = [p for _, argv in shell_commands(blocks(page)[0]) for p in check_command(argv)]
    assert len(problems) == 2 and "--num-block" in problems[0] and "tset" in problems[1]
    assert (ROOT / "conversion/convert.py").is_file()
