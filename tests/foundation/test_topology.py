import pytest

from pptrace.topology import Layout


def test_megatron_tables_tp2_pp2_dp2():
    layout = Layout(tp=2, pp=2, dp=2)
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.groups("cp") == [[r] for r in range(8)]


def test_megatron_tables_tp2_cp2_pp2():
    layout = Layout(tp=2, cp=2, pp=2, dp=1)
    assert layout.groups("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_megatron_rank_formula_and_round_trip():
    layout = Layout(tp=2, cp=2, pp=3, dp=2)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == c.tp + 2 * (c.cp + 2 * (c.dp + 2 * c.pp))
        assert layout.rank(**c._asdict()) == rank


def test_other_order_strings():
    # Megatron's --use-tp-pp-dp-mapping order: pp varies before dp.
    layout = Layout(tp=2, pp=2, dp=2, order="tp-cp-ep-pp-dp")
    assert layout.order == "tp-cp-pp-dp"
    assert layout.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # picotron's grid (dp, pp, cp, tp) has tp fastest then cp, pp, dp.
    assert Layout(tp=2, pp=2, dp=2, order="dp-pp-cp-tp").groups("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_pipeline_neighbours():
    layout = Layout(tp=2, pp=4)
    assert layout.pipeline_next_rank(0) == 2
    assert layout.pipeline_prev_rank(0) is None
    assert layout.pipeline_prev_rank(0, wrap=True) == 6
    assert layout.pipeline_next_rank(7) is None
    assert layout.pipeline_next_rank(7, wrap=True) == 1


def test_enabled_properties_dict_and_describe():
    layout = Layout(tp=2, pp=2)
    assert layout.tp_enabled and layout.pp_enabled and not layout.cp_enabled and not layout.dp_enabled
    assert Layout.from_dict(layout.to_dict()) == layout
    assert layout.describe(3) == "pp1 tp1"
    assert Layout().describe(0) == "single"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=0), "Layout.tp must be a positive integer, got 0"),
        (dict(dp=2.0), "Layout.dp must be a positive integer"),
        (dict(order="tp-dp-pp"), "Layout.order 'tp-dp-pp'"),
        (dict(order="tp-cp-dp-dp"), "permutation"),
    ],
)
def test_invalid_layouts_name_the_bad_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Layout(**kwargs)


def test_out_of_range_rank_and_coordinate():
    layout = Layout(tp=2)
    with pytest.raises(ValueError, match="rank 2 is outside world size 2"):
        layout.coords(2)
    with pytest.raises(ValueError, match="tp coordinate 2"):
        layout.rank(tp=2)
    with pytest.raises(ValueError, match="unknown parallel dimension 'xp'"):
        layout.group_ranks("xp", 0)


@pytest.mark.parametrize("tp,cp,dp,pp,ep", [(1, 1, 4, 1, 4), (1, 1, 4, 2, 2), (2, 2, 2, 2, 4), (2, 1, 4, 1, 2),
                                            (1, 2, 2, 1, 2)])
def test_expert_groups_are_megatrons(tp, cp, dp, pp, ep):
    """The ep and expert-data-parallel groups are those of Megatron-Core's own expert rank
    generator (expert tp = tp), which carves ep out of the dp x cp ranks."""
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    layout = Layout(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    experts = parallel_state.RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-ep-dp-pp")
    assert layout.groups("ep") == sorted(experts.get_ranks("ep"))
    assert layout.groups("edp") == sorted(experts.get_ranks("dp"))
    dense = parallel_state.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    assert layout.groups("dp") == sorted(dense.get_ranks("dp"))
    assert Layout.from_dict(layout.to_dict()) == layout


def test_ep_must_divide_the_data_parallel_ranks():
    with pytest.raises(ValueError, match="Layout.ep 3 must divide dp\\*cp = 4"):
        Layout(dp=4, ep=3)
    assert "ep" not in Layout(dp=4).to_dict()  # a dense run's metadata as it always was
