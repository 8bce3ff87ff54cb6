"""Exact success rates of reference policies on envs/frozenlake.rhai's maps, to read a trained
model's validation against: what blind play scores, what the shortest-path solver scores, and the
best any policy can do, within a turn budget of T turns x K actions.

    python3 tools/frozenlake_odds.py                 # 400 maps, RAGEN's 1/3 ice and RAGEN-2's 0.8
    python3 tools/frozenlake_odds.py --maps 1000 --turns 5 --per-turn 2

The maps follow the env's generator (4x4, each cell frozen with p 0.8, start and goal at distinct
random cells, redrawn until the goal is reachable) from Python's RNG, so they are other draws from
the same distribution. Each value is an expectation over the ice's slips, computed exactly by
recursion over (cell, turns left); an episode ends at the goal or in a hole, and a turn's actions
stop there too. No model is run.
"""
import argparse
import functools
import itertools
import random

N = 4


def generate(rng, frozen_p=0.8):
    while True:
        holes = [rng.random() >= frozen_p for _ in range(N * N)]
        start, goal = rng.randrange(N * N), rng.randrange(N * N)
        if start == goal:
            continue
        holes[start] = holes[goal] = False
        if goal in reachable(holes, start):
            return tuple(holes), start, goal


def moved(i, a):
    """gymnasium's numbering: 0 Left, 1 Down, 2 Right, 3 Up; the edge stops a move."""
    r, c = divmod(i, N)
    r, c = [(r, max(c - 1, 0)), (min(r + 1, N - 1), c), (r, min(c + 1, N - 1)), (max(r - 1, 0), c)][a]
    return r * N + c


def reachable(holes, start):
    seen, stack = {start}, [start]
    while stack:
        i = stack.pop()
        for j in (moved(i, a) for a in range(4)):
            if j not in seen and not holes[j]:
                seen.add(j)
                stack.append(j)
    return seen


def outcomes(i, a, success_rate):
    """The intended move, else one of the two perpendicular ones, equally likely."""
    slip = (1 - success_rate) / 2
    return [(moved(i, a), success_rate), (moved(i, (a + 3) % 4), slip), (moved(i, (a + 1) % 4), slip)]


def shortest_path(holes, start, goal):
    """The env's `solve`: breadth-first over non-hole cells, actions tried in order 0..3."""
    came = {start: None}
    queue = [start]
    for i in queue:
        if i == goal:
            break
        for a in range(4):
            j = moved(i, a)
            if j != i and j not in came and not holes[j]:
                came[j] = (i, a)
                queue.append(j)
    path, i = [], goal
    while came.get(i):
        i, a = came[i]
        path.insert(0, a)
    return path


def value(holes, start, goal, success_rate, turns, answers):
    """Success probability when each turn plays an answer (a tuple of actions) drawn from
    `answers(cell, turns_left)`: a list of (probability, answer), or the best answer when it
    returns None (the optimum over all answers of 1..K actions)."""

    def play(i, answer, left):
        done, dist = 0.0, {i: 1.0}
        for a in answer:
            nxt = {}
            for x, px in dist.items():
                for y, py in outcomes(x, a, success_rate):
                    if y == goal:
                        done += px * py
                    elif not holes[y]:
                        nxt[y] = nxt.get(y, 0.0) + px * py
            dist = nxt
        return done + sum(px * win(x, left - 1) for x, px in dist.items())

    @functools.lru_cache(None)
    def win(i, left):
        if i == goal:
            return 1.0
        if holes[i] or left == 0:
            return 0.0
        choice = answers(i, left)
        if choice is None:
            return max(play(i, ans, left) for ans in ALL_ANSWERS)
        return sum(p * play(i, ans, left) for p, ans in choice)

    return win(start, turns)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--maps", type=int, default=400)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--per-turn", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    k = args.per_turn
    global ALL_ANSWERS
    ALL_ANSWERS = [ans for n in range(1, k + 1) for ans in itertools.product(range(4), repeat=n)]
    rng = random.Random(args.seed)
    maps = [generate(rng) for _ in range(args.maps)]
    print(f"{args.maps} maps, {args.turns} turns x up to {k} actions")
    for success_rate in (1 / 3, 0.8, 1.0):
        uniform_len = [(1 / len(ALL_ANSWERS), ans) for ans in ALL_ANSWERS]
        full = [ans for ans in ALL_ANSWERS if len(ans) == k]
        uniform_full = [(1 / len(full), ans) for ans in full]
        policies = {
            "blind, uniform over every answer": lambda m: (lambda i, left: uniform_len),
            f"blind, uniform over {k}-action answers": lambda m: (lambda i, left: uniform_full),
            "shortest path, re-planned each turn (solve)": lambda m: (
                lambda i, left: [(1.0, tuple(shortest_path(m[0], i, m[2])[:k]) or (0,))]
            ),
            "best possible (knows the slip odds)": lambda m: (lambda i, left: None),
        }
        print(f"ice success_rate {success_rate:.2f}:")
        for name, make in policies.items():
            v = sum(value(h, s, g, success_rate, args.turns, make((h, s, g))) for h, s, g in maps) / len(maps)
            print(f"  {v:.3f}  {name}")
        fixed = max(
            (sum(value(h, s, g, success_rate, args.turns, lambda i, left, a=ans: [(1.0, a)]) for h, s, g in maps)
             / len(maps), ans)
            for ans in ALL_ANSWERS
        )
        print(f"  {fixed[0]:.3f}  best blind fixed answer ({' || '.join('LDRU'[a] for a in fixed[1])})")


if __name__ == "__main__":
    main()
