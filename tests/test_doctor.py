"""`rayapp doctor`'s reading of its figures: which pairs and nodes are far below the others."""

from __future__ import annotations

from rayapp.launch.doctor import PairResult, slow_nodes, slow_pairs

MB = 1e6


def pair(a: str, b: str, *, latency_ms: float = 0.2, mb_s: float = 1000.0) -> PairResult:
    return PairResult((a, b), "gloo", latency_ms / 1e3, mb_s * MB)


def test_one_slow_node_flags_its_pairs_and_itself():
    pairs = [
        pair("a", "b", mb_s=90),
        pair("a", "c", mb_s=100),
        pair("b", "c", mb_s=1000),
        pair("a", "d", mb_s=95),
        pair("b", "d", mb_s=950),
        pair("c", "d", mb_s=1100),
    ]
    slow = slow_pairs(pairs)
    assert slow == {("a", "b"), ("a", "c"), ("a", "d")}
    assert slow_nodes(pairs, slow) == {"a"}


def test_even_pairs_flag_nothing():
    pairs = [pair("a", "b", mb_s=1000), pair("a", "c", mb_s=800), pair("b", "c", mb_s=1200)]
    assert slow_pairs(pairs) == set()


def test_latency_must_be_twice_the_others_and_a_millisecond_more():
    jitter = [pair("a", "b", latency_ms=0.1), pair("a", "c", latency_ms=0.1)]
    assert slow_pairs([*jitter, pair("b", "c", latency_ms=0.5)]) == set()  # 5x, but 0.4 ms
    assert slow_pairs([*jitter, pair("b", "c", latency_ms=20)]) == {("b", "c")}


def test_a_lone_pair_has_nothing_to_compare_with():
    lone = [pair("a", "b", mb_s=1)]
    assert slow_pairs(lone) == set() and slow_nodes(lone, set()) == set()


def test_two_nodes_name_no_slow_node_even_when_their_pair_is_slow():
    pairs = [pair("a", "b", mb_s=1)]
    assert slow_nodes(pairs, {("a", "b")}) == set()


def test_failed_pairs_are_left_out_of_the_yardstick():
    pairs = [
        pair("a", "b", mb_s=1000),
        PairResult(("a", "c"), "gloo", error="Timed out"),
        pair("b", "c", mb_s=100),
    ]
    assert slow_pairs(pairs) == {("b", "c")}


def test_a_failed_pairs_error_is_shown_as_text_not_read_as_markup():
    from rich.console import Console

    from rayapp.cli.doctor import pairs_table
    from rayapp.launch.doctor import Diagnosis

    # Gloo's errors quote its source file in brackets, which rich would take for a closing tag.
    error = "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152] timed out"
    diagnosis = Diagnosis(nodes=[], pairs=[PairResult(("a", "b"), "gloo", error=error)])
    console = Console(record=True, width=400)
    console.print(pairs_table(diagnosis))
    assert "[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:152]" in console.export_text()
