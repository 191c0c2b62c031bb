"""--draft suffix / suffix+DIR / suffix+model (with --model) on the command line, down to the EngineConfig."""

import pytest

from minedraft.cli.common import _engine_kw
from minedraft.cli.main import build_parser
from minedraft.config import DEFAULT_DRAFT


def kw(*argv):
    return _engine_kw(build_parser().parse_args(["generate", "x", *argv]))


def test_draft_strings_reach_the_config():
    assert kw("--draft", "suffix")["draft"] == "suffix"
    assert kw("--draft", f"suffix+{DEFAULT_DRAFT}", "--hybrid-threshold", "2.5") | {} == {
        **kw(), "draft": f"suffix+{DEFAULT_DRAFT}", "hybrid_threshold": 2.5}
    from minedraft.cli.models import resolve_model
    target, draft = resolve_model("tiny")
    tiny = kw("--model", "tiny", "--draft", "suffix")
    assert tiny["draft"] == "suffix" and tiny["target"] == target
    assert kw("--model", "tiny", "--draft", "suffix+model")["draft"] == f"suffix+{draft}"
    assert kw("--model", "tiny")["draft"] == draft  # a named pair keeps its own draft otherwise


def test_bad_suffix_draft_is_one_line_error(capsys):
    from minedraft.cli.main import main
    assert main(["generate", "x", "--draft", "suffix+/nowhere"]) == 2
    assert "not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "x", "--hybrid-threshold", "abc"])
