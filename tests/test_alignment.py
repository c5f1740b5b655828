"""Word timestamps: DTW over cross-attention (guide §8)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from whistle_stream.alignment import dtw_path, sounding_frames, token_frames, trim_to_sound, word_times

SP = "\u2581"


def naive_dtw(cost):
    """The slow twin of alignment._dtw: the same recurrence and tie order in plain Python."""
    n, m = cost.shape
    acc = [[float("inf")] * (m + 1) for _ in range(n + 1)]
    acc[0][0] = 0.0
    move = {}
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            options = [(acc[i - 1][j - 1], (i - 1, j - 1)), (acc[i - 1][j], (i - 1, j)), (acc[i][j - 1], (i, j - 1))]
            best = min(o[0] for o in options)
            prev = next(p for c, p in options if c == best)  # first of equals: diagonal, token, frame
            acc[i][j] = float(cost[i - 1, j - 1]) + best
            move[i, j] = prev
    path, at = [], (n, m)
    while at != (0, 0):
        path.append((at[0] - 1, at[1] - 1))
        at = move[at]
    return path[::-1]


def all_paths_min_cost(cost):
    """Brute force: the cheapest of every monotonic path (small matrices only)."""
    n, m = cost.shape
    best = float("inf")

    def walk(i, j, acc):
        nonlocal best
        acc += cost[i, j]
        if (i, j) == (n - 1, m - 1):
            best = min(best, acc)
            return
        for di, dj in ((1, 1), (1, 0), (0, 1)):
            if i + di < n and j + dj < m:
                walk(i + di, j + dj, acc)

    walk(0, 0, 0.0)
    return best


def path_cost(cost, tok, frm):
    return float(cost[tok, frm].sum())


# ---------------------------------------------------------------- dtw_path

def test_dtw_follows_the_cheap_cells_of_a_hand_built_matrix():
    # token 0 on frames 0-2, token 1 on frames 3-4, token 2 on frames 5-8
    segments = [0, 0, 0, 1, 1, 2, 2, 2, 2]
    cost = np.ones((3, 9))
    cost[segments, np.arange(9)] = 0.0
    tok, frm = dtw_path(cost)
    assert list(frm) == list(range(9))
    assert list(tok) == segments


def test_dtw_on_more_tokens_than_frames_steps_tokens_within_a_frame():
    cost = np.ones((4, 2))
    cost[[0, 1, 2, 3], [0, 0, 1, 1]] = 0.0
    tok, frm = dtw_path(cost)
    assert list(zip(tok, frm)) == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_dtw_path_is_monotonic_and_spans_both_axes():
    rng = np.random.default_rng(1)
    cost = rng.normal(size=(7, 19))
    tok, frm = dtw_path(cost)
    steps = set(zip(np.diff(tok), np.diff(frm)))
    assert steps <= {(1, 1), (1, 0), (0, 1)}
    assert (tok[0], frm[0]) == (0, 0) and (tok[-1], frm[-1]) == (6, 18)


@pytest.mark.parametrize("shape", [(1, 1), (1, 6), (6, 1), (3, 4), (5, 5), (4, 7)])
@pytest.mark.parametrize("seed", range(3))
def test_dtw_finds_the_cheapest_monotonic_path(shape, seed):
    cost = np.random.default_rng(seed).uniform(-1, 1, shape)
    tok, frm = dtw_path(cost)
    assert path_cost(cost, tok, frm) == pytest.approx(all_paths_min_cost(cost), abs=1e-12)


@pytest.mark.parametrize("shape", [(2, 3), (12, 40), (40, 12), (30, 30)])
def test_dtw_kernel_matches_its_numpy_twin(shape):
    rng = np.random.default_rng(sum(shape))
    for cost in (rng.normal(size=shape), np.round(rng.normal(size=shape)), np.zeros(shape)):  # ties too
        tok, frm = dtw_path(cost)
        assert list(zip(tok.tolist(), frm.tolist())) == naive_dtw(cost)


def test_dtw_rejects_bad_cost_matrices():
    with pytest.raises(ValueError, match="2-D"):
        dtw_path(np.zeros(5))
    with pytest.raises(ValueError, match="non-empty"):
        dtw_path(np.zeros((0, 3)))
    with pytest.raises(ValueError, match="finite"):
        dtw_path(np.array([[0.0, np.nan]]))


def all_paths(n, m):
    """Every monotonic path from (0, 0) to (n-1, m-1) as a list of cells (small matrices only)."""
    out = []

    def walk(path):
        i, j = path[-1]
        if (i, j) == (n - 1, m - 1):
            out.append(list(path))
            return
        for di, dj in ((1, 1), (1, 0), (0, 1)):
            if i + di < n and j + dj < m:
                walk(path + [(i + di, j + dj)])

    walk([(0, 0)])
    return out


def long_silent_runs(sounding, min_frames=2):
    """Frames of silent runs of at least min_frames, found the slow way."""
    out, run = [False] * len(sounding), []
    for j, on in enumerate(list(sounding) + [True]):
        if on:
            if len(run) >= min_frames:
                for k in run:
                    out[k] = True
            run = []
        else:
            run.append(j)
    return out


def violations(path, unit_start, needs_sound, sounding):
    """The slow twin of the pause rule in alignment._dtw, stated on a whole path: a unit boundary
    inside sound (both units share a sounding frame, or the frames either side of it both sound),
    a word unit without a sounding frame, each time a word sounds again after a long pause (two or
    more silent frames) that followed its sound, and a unit that is not a word with sound count one."""
    rows = max(i for i, _ in path) + 1
    frames = [[j for i, j in path if i == r] for r in range(rows)]
    unit = np.cumsum(unit_start)
    pause = long_silent_runs(sounding)
    v = 0
    for r in range(1, rows):
        if unit_start[r]:
            before, after = frames[r - 1][-1], frames[r][0]
            v += bool(sounding[after]) if after == before else bool(sounding[before] and sounding[after])
    for u in set(unit.tolist()):
        members = [r for r in range(rows) if unit[r] == u]
        seen = sorted({j for r in members for j in frames[r]})
        if not needs_sound[members[0]]:
            v += any(sounding[j] for j in seen)
            continue
        if not any(sounding[j] for j in seen):
            v += 1
        heard = paused = False
        for j in seen:
            if sounding[j]:
                v += heard and paused
                heard, paused = True, False
            elif pause[j] and heard:
                paused = True
    return v


def best_paused_score(cost, unit_start, needs_sound, sounding):
    """Brute force: the least (violations, cost) over every monotonic path."""
    return min((violations(p, unit_start, needs_sound, sounding), float(sum(cost[i, j] for i, j in p)))
               for p in all_paths(*cost.shape))


@pytest.mark.parametrize("shape", [(1, 4), (3, 3), (4, 6), (5, 7), (6, 5), (3, 9), (4, 8)])
@pytest.mark.parametrize("seed", range(4))
def test_paused_dtw_finds_the_path_with_fewest_violations_then_least_cost(shape, seed):
    rng = np.random.default_rng(100 * seed + sum(shape))
    n, m = shape
    cost = rng.uniform(-1, 1, shape)
    unit_start = rng.random(n) < 0.5
    unit_start[0] = True
    needs_sound = (rng.random(n) < 0.7)[np.cumsum(unit_start) - 1]  # one flag per unit
    sounding = rng.random(m) < 0.6
    tok, frm = dtw_path(cost, unit_start, needs_sound, sounding)
    path = list(zip(tok.tolist(), frm.tolist()))
    assert path in all_paths(n, m)
    got = (violations(path, unit_start, needs_sound, sounding), path_cost(cost, tok, frm))
    want = best_paused_score(cost, unit_start, needs_sound, sounding)
    assert got[0] == want[0] and got[1] == pytest.approx(want[1], abs=1e-12)


@pytest.mark.parametrize("shape", [(5, 9), (12, 40), (30, 30)])
def test_paused_dtw_without_pauses_is_the_plain_path(shape):
    """Audio that never pauses (every frame sounding) or rows with no units leave §8's path as it is."""
    rng = np.random.default_rng(sum(shape))
    n, m = shape
    unit_start = rng.random(n) < 0.4
    unit_start[0] = True
    for cost in (rng.normal(size=shape), np.round(rng.normal(size=shape))):
        plain = naive_dtw(cost)
        for args in ((unit_start, np.ones(n, bool), np.ones(m, bool)), (np.zeros(n, bool), np.zeros(n, bool), rng.random(m) < 0.5)):
            tok, frm = dtw_path(cost, *args)
            assert list(zip(tok.tolist(), frm.tolist())) == plain


def test_paused_dtw_moves_a_word_boundary_into_the_pause_and_gives_every_word_sound():
    # two one-token words; sound on frames 0-2 and 6-8, a pause on 3-5. The cost pulls word 1 onto
    # frames 0-4 and leaves word 2 only the pause's last frame and the second sound.
    sounding = np.array([1, 1, 1, 0, 0, 0, 1, 1, 1], bool)
    cost = np.zeros((2, 9))
    cost[0, :8] = -1.0
    tok, frm = dtw_path(cost)
    assert frm[tok == 1].min() == 8  # §8 alone: the boundary inside the second sound
    tok, frm = dtw_path(cost, [True, True], [True, True], sounding)
    assert frm[tok == 0].max() in (2, 3, 4, 5) and frm[tok == 1].min() in (3, 4, 5, 6)  # in the pause
    assert sounding[frm[tok == 1]].any() and sounding[frm[tok == 0]].any()
    # three words on two sounds: one boundary must lie inside sound, the cost says which
    cost3 = np.zeros((3, 9))
    cost3[1, 7] = -5.0
    tok, frm = dtw_path(cost3, [True] * 3, [True] * 3, sounding)
    assert 7 in frm[tok == 1].tolist() and all(sounding[frm[tok == r]].any() for r in range(3))


def test_paused_dtw_keeps_a_one_frame_gap_inside_a_word_and_no_word_across_a_long_pause():
    # "pick up the": pi (0-1), a one-frame closure (2), ck (3), a long pause (4-6), up (7-8),
    # a long pause (9-11), the (12-13). The cost pulls "pick" onto 0-1 and "up" onto 2-8.
    sounding = np.array([1, 1, 0, 1, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1], bool)
    cost = np.zeros((3, 14))
    cost[0, :2] = -1.0
    cost[1, 2:9] = -1.0
    tok, frm = dtw_path(cost)
    assert frm[tok == 1].min() <= 3  # §8 alone: "up" takes the closure's burst
    tok, frm = dtw_path(cost, [True] * 3, [True] * 3, sounding)
    assert frm[tok == 0].max() >= 3 and frm[tok == 1].min() >= 4  # "pick" keeps its burst
    assert frm[tok == 1].max() <= 11 and frm[tok == 2].min() >= 9


def test_paused_dtw_rejects_partial_or_misshapen_pause_arguments():
    with pytest.raises(ValueError, match="all three"):
        dtw_path(np.zeros((2, 3)), unit_start=[True, False])
    with pytest.raises(ValueError, match="sounding"):
        dtw_path(np.zeros((2, 3)), [True, False], [True, True], [True, False])
    with pytest.raises(ValueError, match="same for every row of a unit"):
        dtw_path(np.zeros((2, 3)), [True, False], [True, False], [True, False, True])


# ---------------------------------------------------------------- word times

class PieceTokenizer:
    def __init__(self, pieces, with_id_to_piece=True):
        self.pieces = pieces
        if with_id_to_piece:
            self.id_to_piece = lambda i: self.pieces[i]

    def decode(self, ids):
        return "".join(self.pieces[i] for i in ids).replace(SP, " ").lstrip(" ")


PIECES = [SP + "the", SP + "Ka", "li", "ko", SP + "cat", ",", SP + "sat", "."]


def attention(segments, frames, heads=6, noise_heads=2, seed=0):
    """(heads, tokens, frames) weights: aligned heads peak on each token's frames (softmax-like
    rows over frames), noise heads are random. segments[i] = (first_frame, end_frame)."""
    rng = np.random.default_rng(seed)
    n = len(segments)
    w = rng.uniform(0.0, 0.2, (heads + noise_heads, n, frames))
    for h in range(heads):
        for i, (a, b) in enumerate(segments):
            w[h, i, a:b] += rng.uniform(2.0, 3.0)
    w /= w.sum(axis=2, keepdims=True)
    return w.astype(np.float32)


SEGMENTS = [(0, 3), (3, 5), (5, 6), (6, 8), (10, 14), (14, 15), (16, 20), (20, 21)]
PROBS = [0.9, 0.5, 0.6, 0.7, 0.95, 0.8, 0.85, 0.99]


def test_token_frames_recover_the_attended_segments():
    first, end = token_frames(attention(SEGMENTS, frames=24))
    # each token covers its attended frames; silent frames (8-9, 15, 21-23) may join a neighbour,
    # and a token step (1, 0) lets two neighbours share one frame, but no more
    bounds = [(0, 0)] + SEGMENTS + [(24, 24)]
    for k, ((a, b), f, e) in enumerate(zip(SEGMENTS, first, end)):
        assert f <= a and e >= b
        assert f >= bounds[k][1] - 1 and e <= bounds[k + 2][0] + 1


def test_words_start_at_space_pieces_and_carry_their_times_and_mean_probability():
    words = word_times(attention(SEGMENTS, frames=24), list(range(8)), PROBS, PieceTokenizer(PIECES),
                       frame_seconds=0.08, offset_s=10.0)
    assert [w["word"] for w in words] == ["the", "Kaliko", "cat,", "sat."]
    kaliko = words[1]
    assert kaliko["probability"] == pytest.approx(np.mean(PROBS[1:4]))
    assert kaliko["start"] == pytest.approx(10.0 + 3 * 0.08)  # its first piece's first frame
    assert 10.0 + 8 * 0.08 - 1e-9 <= kaliko["end"] <= 10.0 + 10 * 0.08 + 1e-9  # may take the gap
    assert words[2]["start"] >= kaliko["end"]
    assert words[3]["end"] == pytest.approx(10.0 + 24 * 0.08)  # the last word ends with the window


def test_word_times_are_ordered_non_overlapping_and_inside_the_window():
    rng = np.random.default_rng(7)
    for frames in (3, 8, 24, 60):
        w = rng.uniform(size=(4, 8, frames)).astype(np.float32)
        for sounding in (None, rng.random(frames) < 0.5):  # §8's path, and the path through pauses
            words = word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, offset_s=5.0,
                               sounding=sounding)
            assert words
            prev = 5.0
            for word in words:
                assert prev <= word["start"] <= word["end"] <= 5.0 + frames * 0.08 + 1e-9
                prev = word["end"]


def test_decode_only_tokenizers_split_words_the_same_way():
    w = attention(SEGMENTS, frames=24)
    with_pieces = word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08)
    decode_only = word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES, with_id_to_piece=False), 0.08)
    assert with_pieces == decode_only


def test_a_single_token_spans_the_whole_clip():
    words = word_times(np.ones((2, 1, 5), np.float32), [4], [0.5], PieceTokenizer(PIECES), 0.08)
    assert words == [{"word": "cat", "start": 0.0, "end": 0.4, "probability": 0.5}]


def test_no_tokens_gives_no_words():
    assert word_times(np.zeros((2, 0, 5)), [], [], PieceTokenizer(PIECES), 0.08) == []


def test_mismatched_inputs_are_rejected():
    with pytest.raises(ValueError, match="token_ids"):
        word_times(np.zeros((2, 3, 5)), [0, 1], [0.5, 0.5], PieceTokenizer(PIECES), 0.08)
    with pytest.raises(ValueError, match="frame_seconds"):
        word_times(np.zeros((2, 1, 5)), [0], [0.5], PieceTokenizer(PIECES), 0.0)


def test_every_frame_and_token_is_on_the_path():
    # property: a DTW path visits every token row and every frame column
    rng = np.random.default_rng(3)
    for n, m in itertools.product((1, 4, 9), (1, 5, 13)):
        tok, frm = dtw_path(rng.normal(size=(n, m)))
        assert set(tok.tolist()) == set(range(n)) and set(frm.tolist()) == set(range(m))


def test_lead_and_trail_rows_take_the_silence_around_the_words():
    """Rows before and after the tokens (the model's tag- and </s>-predicting rows) join the path
    and take the frames before the first word and after the last: the first word then starts at
    its own frames instead of frame 0."""
    shifted = [(a + 6, b + 6) for a, b in SEGMENTS]  # 6 silent frames first, 5 after the last word
    rows = [(0, 6)] + shifted + [(27, 32)]
    w = attention(rows, frames=32)
    words = word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=1)
    assert words[0]["start"] == pytest.approx(6 * 0.08)
    assert words[-1]["end"] <= 27 * 0.08 + 1e-9
    no_rows = word_times(w[:, 1:-1], list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08)
    assert no_rows[0]["start"] == 0.0 and no_rows[-1]["end"] == pytest.approx(32 * 0.08)  # what they fix
    with pytest.raises(ValueError, match="lead"):
        word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=0)


def test_word_times_put_each_word_on_its_own_sound_where_the_audio_pauses():
    """Attention that says nothing (random weights, as a weak model's can be): where the audio
    pauses between words, the pauses decide the boundaries, and the trim puts each word on its
    sound. Without the sounding frames the path is §8's alone."""
    sounds = [(3, 6), (8, 13), (15, 19), (22, 26)]  # "the", "Kaliko", "cat,", "sat."
    sounding = np.zeros(30, bool)
    for a, b in sounds:
        sounding[a:b] = True
    rng = np.random.default_rng(5)
    hits = 0
    for _ in range(5):
        w = rng.uniform(size=(2, 10, 30)).astype(np.float32)
        words = word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=1, sounding=sounding)
        words = trim_to_sound(words, sounding, 0.08)
        assert [(round(x["start"] / 0.08), round(x["end"] / 0.08)) for x in words] == sounds
        plain = trim_to_sound(word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=1),
                              sounding, 0.08)
        hits += [(round(x["start"] / 0.08), round(x["end"] / 0.08)) for x in plain] == sounds
    assert hits < 5  # what the pauses fix
    loud = np.ones(30, bool)  # no pause: the path is §8's
    assert word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=1, sounding=loud) == \
        word_times(w, list(range(8)), PROBS, PieceTokenizer(PIECES), 0.08, lead=1, trail=1)


def test_sounding_frames_marks_frames_within_the_floor_of_the_speech_level():
    frame = 1280
    pcm = np.zeros(10 * frame, np.float32)
    pcm[2 * frame:5 * frame] = 0.5 * np.sin(np.arange(3 * frame) * 0.2)  # speech
    pcm[7 * frame:8 * frame] = 0.5e-3  # -60 dB of it: not sound at a 35 dB floor
    got = sounding_frames(pcm, frame, 11)  # one frame past the audio reads as zeros
    assert got.tolist() == [False, False, True, True, True, False, False, False, False, False, False]
    assert sounding_frames(pcm, frame, 11, floor_db=70.0)[7]
    assert sounding_frames(np.zeros(3 * frame, np.float32), frame, 3).all()  # nothing stands out
    with pytest.raises(ValueError, match="frame_samples"):
        sounding_frames(pcm, 0, 3)


def test_trim_to_sound_shrinks_word_edges_to_sounding_frames_only():
    sounding = np.array([0, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0], bool)
    words = [{"word": "a", "start": 0.0, "end": 0.48, "probability": 1.0},  # frames 0-5: sound 1-2
             {"word": "b", "start": 0.48, "end": 0.96, "probability": 1.0},  # frames 6-11: sound 6-8
             {"word": "c", "start": 0.96, "end": 0.96, "probability": 1.0}]  # empty span: unchanged
    got = trim_to_sound(words, sounding, 0.08)
    assert [(w["start"], w["end"]) for w in got] == [(0.08, 0.24), (0.48, 0.72), (0.96, 0.96)]
    quiet = trim_to_sound(words, np.zeros(12, bool), 0.08)
    assert quiet == words  # no sounding frame: the path's spans stay
    shifted = trim_to_sound([{**w, "start": w["start"] + 1.0, "end": w["end"] + 1.0} for w in words], sounding, 0.08, 1.0)
    assert [(w["start"], w["end"]) for w in shifted] == [(1.08, 1.24), (1.48, 1.72), (1.96, 1.96)]
