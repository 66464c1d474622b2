"""rmt.memory.comm_volume (and rmt.planner.comm's plot) against UltraMem Appendix D, Fig. 9 and the derived variants."""

import itertools
import random

import pytest

from rmt.memory.comm_volume import boundary_v_dim, choose_partition, comm_volume, expected_unique, plan_comm


def appendix_d(T, K, D, P):
    """Appendix D's bullet formulas, transcribed (int = 4 bytes, bfloat16 = 2 bytes)."""
    number = {"all_to_all_indices": 4 * T * K * (P - 1) / P, "all_to_all_values": 2 * T * K * D * (P - 1) / P}
    dimension = {
        "all_gather_indices": 4 * T * K * (P - 1),
        "all_gather_scores": 2 * T * K * (P - 1),
        "all_to_all_pooled": 2 * T * D * (P - 1) / P,
    }
    return number, dimension


def test_appendix_d_hand_computed_shape():
    # T=4096, K=32, D=64, P=8:
    #   4*4096*32*7/8 = 458752, 2*4096*32*64*7/8 = 14680064,
    #   4*4096*32*7 = 3670016, 2*4096*32*7 = 1835008, 2*4096*64*7/8 = 458752.
    number = comm_volume("number", 4096, 32, 64, 8)
    dimension = comm_volume("dimension", 4096, 32, 64, 8)
    assert number["forward"] == {"all_to_all_indices": 458752, "all_to_all_values": 14680064}
    assert dimension["forward"] == {
        "all_gather_indices": 3670016,
        "all_gather_scores": 1835008,
        "all_to_all_pooled": 458752,
    }
    plan = plan_comm(4096, 32, 64, 8)
    assert plan["number_bytes"] == 458752 + 14680064
    assert plan["dimension_bytes"] == 3670016 + 1835008 + 458752
    assert plan["choice"] == "dimension"


@pytest.mark.parametrize(
    "T,K,D,P", [(1000, 16, 256, 4), (2048, 2, 8, 16), (64, 84, 448, 2), (8192, 8, 1024, 32), (12, 3, 16, 3)]
)
def test_appendix_d_formulas_exact(T, K, D, P):
    number, dimension = appendix_d(T, K, D, P)
    for part, expected in (("number", number), ("dimension", dimension)):
        got = comm_volume(part, T, K, D, P)["forward"]
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert value == int(value)
            assert got[name] == int(value)
    plan = plan_comm(T, K, D, P)
    assert plan["number_bytes"] == sum(number.values())
    assert plan["dimension_bytes"] == sum(dimension.values())


def test_group_of_one_sends_nothing():
    plan = plan_comm(4096, 32, 64, 1, phase="forward_backward")
    assert plan["number_bytes"] == plan["dimension_bytes"] == 0
    assert plan["choice"] == "dimension" and plan["ratio"] is None


def test_non_integral_expectation_rounds_half_up_per_collective():
    # T=K=D=1, P=3: indices 4*2/3 = 2.67 -> 3, values 2*2/3 = 1.33 -> 1.
    vol = comm_volume("number", 1, 1, 1, 3)
    assert vol["forward"] == {"all_to_all_indices": 3, "all_to_all_values": 1}
    assert vol["forward_total"] == 4


def test_backward_sends_gradients_of_received_floats():
    T, K, D, P = 4096, 32, 64, 8
    number = comm_volume("number", T, K, D, P)
    assert number["backward"] == {"all_to_all_value_grads": 2 * T * K * D * (P - 1) // P}
    dimension = comm_volume("dimension", T, K, D, P)
    assert dimension["backward"] == {
        "all_to_all_pooled_grads": 2 * T * D * (P - 1) // P,
        "reduce_scatter_score_grads": 2 * T * K * (P - 1),
    }
    for vol in (number, dimension):
        assert vol["forward_total"] == sum(vol["forward"].values())
        assert vol["backward_total"] == sum(vol["backward"].values())
        assert vol["forward_backward_total"] == vol["forward_total"] + vol["backward_total"]


def test_bytes_sent_excludes_local_chunk_by_simulation():
    """Count the bytes of a balanced all-to-all / all-gather rank by rank."""
    T, K, D, P = 6, 4, 8, 3
    for rank in range(P):
        indices = [(rank + j) for j in range(T * K)]  # owner = index % P: T*K/P per owner
        remote_rows = sum(1 for i in indices if i % P != rank)
        vol = comm_volume("number", T, K, D, P)["forward"]
        assert vol["all_to_all_indices"] == 4 * remote_rows
        assert vol["all_to_all_values"] == 2 * D * remote_rows
        gathered_to_others = T * K * (P - 1)
        assert comm_volume("dimension", T, K, D, P)["forward"]["all_gather_indices"] == 4 * gathered_to_others


def test_decision_boundary_matches_fig9_closed_form():
    # Setting the two Appendix D totals equal: (4K + 2KD)/P = 4K + 2K + 2D/P
    # -> D* = K (3P - 2) / (K - 1); number-wise is cheaper below, dimension-wise above.
    for K, P, D in itertools.product((2, 8, 32, 84), (2, 4, 8, 16, 64), (16, 64, 100, 256)):
        d_star = K * (3 * P - 2) / (K - 1)
        assert boundary_v_dim(K, P) == pytest.approx(d_star)
        if D == d_star:
            continue
        assert choose_partition(4096, K, D, P) == ("number" if D < d_star else "dimension")


def test_fig9_trends():
    # The boundary does not depend on the number of tokens.
    for T in (1, 17, 4096, 10**6):
        assert choose_partition(T, 32, 64, 8) == "dimension"
        assert choose_partition(T, 32, 64, 64) == "number"
    # Larger groups favour number-wise, wider values favour dimension-wise.
    assert boundary_v_dim(32, 64) > boundary_v_dim(32, 8)
    assert choose_partition(4096, 32, 512, 64) == "dimension"
    assert choose_partition(4096, 32, 16, 8) == "number"
    # top-m <= E: number-wise always cheaper.
    assert boundary_v_dim(4, 8, ive=4) == float("inf")


def test_appendix_c_statements():
    T, K, D, P = 4096, 32, 128, 16
    base = plan_comm(T, K, D, P)
    half = plan_comm(T, K, D // 2, P)
    assert half["number_bytes"] < base["number_bytes"]
    assert half["dimension_bytes"] < base["dimension_bytes"]
    double_k = plan_comm(T, 2 * K, D, P)
    assert double_k["number_bytes"] == 2 * base["number_bytes"]
    assert double_k["dimension_bytes"] > base["dimension_bytes"]
    ive = plan_comm(T, K, D, P, ive=4)
    assert ive["number_bytes"] == base["number_bytes"]
    assert ive["collectives"]["dimension"]["forward"]["all_to_all_pooled"] == 2 * T * 4 * D * (P - 1) // P


def test_owner_reduce_hand_computed():
    T, K, D, P = 4096, 32, 64, 8
    vol = comm_volume("number", T, K, D, P, owner_reduce=True)
    assert vol["forward"] == {
        "all_to_all_indices": 4 * T * K * 7 // 8,
        "all_to_all_scores": 2 * T * K * 7 // 8,
        "all_to_all_partial_sums": 2 * T * D * 7,
    }
    assert vol["backward"] == {
        "all_to_all_partial_sum_grads": 2 * T * D * 7,
        "all_to_all_score_grads": 2 * T * K * 7 // 8,
    }


def test_owner_reduce_cheaper_exactly_when_derived_condition_holds():
    # Plain values: 2 T K D (P-1)/P. Owner-reduce replaces them by scores
    # 2 T K C (P-1)/P plus partial sums 2 T E D (P-1) (same again in the backward), so
    # owner-reduce is cheaper iff K C / P + E D < K D / P, i.e. K (D - C) > P E D:
    # never for K <= P, and for K > P as soon as D > K C / (K - P E).
    for K, P, D, C, E in itertools.product((1, 4, 8, 9, 16, 64), (2, 4, 8), (8, 64, 128), (1, 2), (1, 2)):
        derived = K * (D - C) > P * E * D
        for phase in ("forward", "forward_backward"):
            plain = plan_comm(4096, K, D, P, cores=C, ive=E, phase=phase)["number_bytes"]
            owner = plan_comm(4096, K, D, P, cores=C, ive=E, phase=phase, owner_reduce=True)["number_bytes"]
            assert (owner < plain) == derived, (K, P, D, C, E, phase)
        if K <= P:
            assert not derived


def test_expected_unique_hand_values_and_monte_carlo():
    assert expected_unique(1, 7, 100) == pytest.approx(7)
    assert expected_unique(50, 10, 10) == 10
    assert expected_unique(2, 1, 2) == pytest.approx(1.5)  # 2 (1 - (1/2)^2)
    N, K, T = 50, 5, 20
    rng = random.Random(0)
    trials = [len(set().union(*(rng.sample(range(N), K) for _ in range(T)))) for _ in range(2000)]
    assert sum(trials) / len(trials) == pytest.approx(N * (1 - (1 - K / N) ** T), abs=0.3)


def test_dedup_never_increases_bytes():
    for T, K, D, P, N in itertools.product((1, 64, 4096), (1, 8, 32), (16, 64), (2, 8), (32, 10**4, 10**9)):
        if K > N:
            continue
        for phase in ("forward", "forward_backward"):
            plain = plan_comm(T, K, D, P, phase=phase)
            dedup = plan_comm(T, K, D, P, phase=phase, dedup=True, slots=N)
            assert dedup["number_bytes"] <= plain["number_bytes"]
            assert dedup["dimension_bytes"] == plain["dimension_bytes"]


def test_dedup_unique_fraction_and_scope():
    T, K, D, P = 4096, 32, 64, 8
    assert plan_comm(T, K, D, P, dedup=True, unique_fraction=1.0) == plan_comm(T, K, D, P)
    half = comm_volume("number", T, K, D, P, dedup=True, unique_fraction=0.5)
    assert half["forward"] == {
        "all_to_all_indices": 4 * (T * K // 2) * 7 // 8,
        "all_to_all_values": 2 * (T * K // 2) * D * 7 // 8,
    }
    assert half["backward"] == {"all_to_all_value_grads": 2 * (T * K // 2) * D * 7 // 8}
    owner = comm_volume("number", T, K, D, P, owner_reduce=True)
    assert comm_volume("number", T, K, D, P, owner_reduce=True, dedup=True, unique_fraction=0.5) == owner
    # A small table saturates: T K = 131072 draws over 1000 slots -> ~1000 unique rows.
    tiny = comm_volume("number", T, K, D, P, dedup=True, slots=1000)
    assert tiny["forward"]["all_to_all_indices"] == round(4 * 1000 * 7 / 8)


def test_multi_core_scoring_and_ive_block_ids():
    T, K, D, P = 512, 16, 64, 4
    plain = comm_volume("number", T, K, D, P)
    assert comm_volume("number", T, K, D, P, cores=2, ive=4) == plain
    dim = comm_volume("dimension", T, K, D, P, cores=2, ive=4)
    assert dim["forward"] == {
        "all_gather_indices": 4 * T * K * 3,
        "all_gather_scores": 2 * T * K * 2 * 3,
        "all_to_all_pooled": 2 * T * 4 * D * 3 // 4,
    }
    sent = comm_volume("dimension", T, K, D, P, ive=4, block_id_bytes=4)
    assert sent["forward"]["all_gather_block_ids"] == 4 * T * K * 3
    owner = comm_volume("number", T, K, D, P, ive=4, block_id_bytes=1, owner_reduce=True)
    assert owner["forward"]["all_to_all_block_ids"] == T * K * 3 // 4
    assert "all_gather_block_ids" not in comm_volume("dimension", T, K, D, P, block_id_bytes=4)["forward"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=0), "tokens"),
        (dict(topm=-1), "topm"),
        (dict(v_dim=64, cores=3), "divisible"),
        (dict(P=0), "group size"),
        (dict(slots=8, topm=16), "exceed"),
        (dict(dedup=True), "exactly one"),
        (dict(dedup=True, slots=100, unique_fraction=0.5), "exactly one"),
        (dict(unique_fraction=0.5), "only meaningful"),
        (dict(dedup=True, unique_fraction=1.5), r"\(0, 1\]"),
        (dict(block_id_bytes=-1), "block_id_bytes"),
    ],
)
def test_invalid_input_raises_value_error(kwargs, match):
    args = dict(tokens=16, topm=4, v_dim=64, P=4)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        comm_volume("number", args.pop("tokens"), args.pop("topm"), args.pop("v_dim"), args.pop("P"), **args)


def test_unknown_partition_and_phase():
    with pytest.raises(ValueError, match="partition"):
        comm_volume("rows", 1, 1, 1, 2)
    with pytest.raises(ValueError, match="phase"):
        plan_comm(1, 1, 1, 2, phase="backward")


def test_tensor_parallel_chunks_the_tokens():
    """t tensor-parallel ranks with the same T tokens each look up T/t of them, then all-gather
    the pooled chunks (and, backward, the score-gradient chunks)."""
    T, K, D, P, E, C = 4096, 32, 64, 8, 4, 2
    for part in ("number", "dimension"):
        for owner_reduce in (False, True):
            base = comm_volume(part, T // 4, K, D, P, owner_reduce=owner_reduce, ive=E, cores=C)
            tp = comm_volume(part, T, K, D, P, owner_reduce=owner_reduce, ive=E, cores=C, tensor_parallel=4)
            assert tp["forward"] == dict(base["forward"], tp_all_gather_pooled=2 * (T // 4) * E * D * 3)
            assert tp["backward"] == dict(base["backward"], tp_all_gather_score_grads=2 * (T // 4) * K * C * 3)
    with pytest.raises(ValueError, match=r"tokens \(10\) must be divisible by tensor_parallel \(4\)"):
        comm_volume("number", 10, K, D, P, tensor_parallel=4)


def test_virtual_addresses_must_fit_the_index_width():
    """The tables switch to int64 indices when E x N > 2^31 - 1; the planner must be told."""
    assert comm_volume("number", 64, 8, 64, 4, dedup=True, slots=2**28, ive=4)["forward_total"] > 0
    with pytest.raises(ValueError, match=r"ive x slots \(2147483648\) virtual addresses do not fit 4-byte"):
        comm_volume("number", 64, 8, 64, 4, dedup=True, slots=2**29, ive=4)
    assert comm_volume("number", 64, 8, 64, 4, dedup=True, slots=2**29, ive=4, index_bytes=8)["forward_total"] > 0


ROW_TERMS = {"all_to_all_values", "all_to_all_value_grads", "all_to_all_indices", "all_gather_indices"}


@pytest.mark.parametrize(
    "partition,options",
    [
        ("number", {}),
        ("number", {"owner_reduce": True}),
        ("dimension", {}),
        ("dimension", {"tensor_parallel": 2}),
        ("number", {"owner_reduce": True, "tensor_parallel": 2}),
    ],
)
def test_activation_bytes_price_scores_and_pooled_outputs_only(partition, options):
    """A bf16 table trained in fp32 sends its rows (and row gradients) in 2 bytes but its scores,
    pooled slices, partial sums and their gradients in 4: each collective is priced as if the
    whole lookup had the dtype of what it carries."""
    T, K, D, P = 96, 12, 48, 4
    shape = dict(ive=4, cores=2, **options)
    mixed = comm_volume(partition, T, K, D, P, value_bytes=2, activation_bytes=4, **shape)
    narrow = comm_volume(partition, T, K, D, P, value_bytes=2, **shape)
    wide = comm_volume(partition, T, K, D, P, value_bytes=4, **shape)
    assert comm_volume(partition, T, K, D, P, value_bytes=2, activation_bytes=2, **shape) == narrow
    for phase in ("forward", "backward"):
        for name, n in mixed[phase].items():
            assert n == (narrow if name in ROW_TERMS else wide)[phase][name], (phase, name)
    plain_number = partition == "number" and not options  # rows at the requester: no scores sent
    assert (mixed == narrow) == plain_number


def test_activation_bytes_move_the_decision_boundary():
    """With 4-byte scores and pooled slices but a 2-byte table, D* = K (P (ib + ab C) - ib) /
    (vb K - ab E): the two forward totals meet there and the choice flips across it."""
    K, P = 32, 8
    d_star = boundary_v_dim(K, P, value_bytes=2, activation_bytes=4)
    assert d_star == pytest.approx(K * (P * (4 + 4) - 4) / (2 * K - 4))
    assert d_star > boundary_v_dim(K, P, value_bytes=2)  # wider scores favour number-wise
    for D in (int(d_star) - 1, int(d_star) + 1):
        choice = choose_partition(4096, K, D, P, value_bytes=2, activation_bytes=4)
        assert choice == ("number" if D < d_star else "dimension"), D
    # vb K <= ab E: number-wise always cheaper
    assert boundary_v_dim(4, 8, ive=2, value_bytes=2, activation_bytes=4) == float("inf")
    with pytest.raises(ValueError, match="activation_bytes must be a positive integer"):
        comm_volume("number", 8, 2, 4, 2, activation_bytes=0)
