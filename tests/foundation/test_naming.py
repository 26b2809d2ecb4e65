import re
from pathlib import Path

import pytest

from pptrace.naming import RangeName, format_name, parse_name

# Every example of DESIGN.md contract 1, written out so the test runs without ../shared.
DESIGN_EXAMPLES = {
    "compute:fwd mb=3 chunk=0": ("compute", "fwd", {"mb": 3, "chunk": 0}),
    "compute:bwd mb=3 chunk=0": ("compute", "bwd", {"mb": 3, "chunk": 0}),
    "compute:bwd_input mb=3": ("compute", "bwd_input", {"mb": 3}),
    "compute:bwd_weight mb=3": ("compute", "bwd_weight", {"mb": 3}),
    "compute:optimizer": ("compute", "optimizer", {}),
    "compute:loss mb=3": ("compute", "loss", {"mb": 3}),
    "pp:send_fwd peer=5 mb=3 chunk=0 bytes=65536": ("pp", "send_fwd", {"peer": 5, "mb": 3, "chunk": 0, "bytes": 65536}),
    "pp:recv_fwd peer=1 mb=3 chunk=0 bytes=65536": ("pp", "recv_fwd", {"peer": 1, "mb": 3, "chunk": 0, "bytes": 65536}),
    "pp:send_bwd peer=1 mb=0": ("pp", "send_bwd", {"peer": 1, "mb": 0}),
    "pp:recv_bwd peer=5 mb=0": ("pp", "recv_bwd", {"peer": 5, "mb": 0}),
    "tp:all_reduce layer=2 bytes=4096": ("tp", "all_reduce", {"layer": 2, "bytes": 4096}),
    "tp:all_gather layer=2": ("tp", "all_gather", {"layer": 2}),
    "tp:reduce_scatter layer=2": ("tp", "reduce_scatter", {"layer": 2}),
    "cp:send_kv peer=3 step=1 layer=2": ("cp", "send_kv", {"peer": 3, "step": 1, "layer": 2}),
    "cp:recv_kv peer=1 step=1 layer=2": ("cp", "recv_kv", {"peer": 1, "step": 1, "layer": 2}),
    "cp:all_to_all layer=2": ("cp", "all_to_all", {"layer": 2}),
    "dp:all_reduce bucket=0 bytes=1024": ("dp", "all_reduce", {"bucket": 0, "bytes": 1024}),
    "dp:reduce_scatter bucket=1": ("dp", "reduce_scatter", {"bucket": 1}),
    "ep:all_to_all layer=0": ("ep", "all_to_all", {"layer": 0}),
    "dp:wait op=all_reduce bucket=0": ("dp", "wait", {"op": "all_reduce", "bucket": 0}),
}


@pytest.mark.parametrize("text, expected", DESIGN_EXAMPLES.items())
def test_design_examples_parse_and_round_trip(text, expected):
    parsed = parse_name(text)
    assert (parsed.kind, parsed.op, parsed.tags) == expected
    assert str(parsed) == text
    assert format_name(parsed.kind, parsed.op, **parsed.tags) == text


def test_design_md_examples_all_parse_when_available():
    design = Path(__file__).resolve().parents[3] / "shared" / "DESIGN.md"
    if not design.exists():
        pytest.skip("../shared/DESIGN.md is not beside this checkout")
    block = design.read_text().split("## Contract 1")[1].split("```")[1]
    # Each example in the block starts with kind:op; take tokens up to the next example.
    names = re.findall(r"(\b(?:compute|pp|tp|cp|dp|ep):[a-z_]+(?: [a-z_]+=[^\s.]+)*)", block)
    assert len(names) >= 15
    for name in names:
        assert parse_name(name) is not None, name
        assert str(parse_name(name)) == name


def test_unknown_kinds_and_tags_are_preserved():
    parsed = parse_name("moe:dispatch expert=7 flavour=top2")
    assert parsed == RangeName("moe", "dispatch", {"expert": 7, "flavour": "top2"})
    assert str(parsed) == "moe:dispatch expert=7 flavour=top2"


def test_non_canonical_integers_stay_strings_so_round_trip_holds():
    assert parse_name("pp:send_fwd peer=007").tags == {"peer": "007"}
    assert str(parse_name("pp:send_fwd peer=007")) == "pp:send_fwd peer=007"
    assert parse_name("x:y delta=-3").tags == {"delta": -3}


@pytest.mark.parametrize(
    "text",
    ["aten::mm", "c10d::allreduce_", "ProfilerStep#3", "", "fwd", "pp:", ":op", "pp:send fwd",
     "pp:send_fwd peer", "pp:send_fwd =3", "pp:send_fwd  mb=1", "gloo send"],
)
def test_non_range_names_parse_to_none(text):
    assert parse_name(text) is None


def test_format_drops_none_tags_and_rejects_bad_input():
    assert format_name("pp", "recv_fwd", peer=1, mb=2, chunk=None) == "pp:recv_fwd peer=1 mb=2"
    with pytest.raises(ValueError, match="no spaces"):
        format_name("pp", "send fwd")
    with pytest.raises(ValueError, match="tag value"):
        format_name("pp", "send_fwd", peer="a b")
    with pytest.raises(ValueError, match="tag key"):
        format_name("pp", "send_fwd", **{"bad-key": 1})
