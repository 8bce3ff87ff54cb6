#!/usr/bin/env python3
"""Writes a synthetic run directory in the trainer's layout (docs/contracts.md, "The run
directory"), to measure the dashboard on a run of a given size without training one:

    python3 tools/synthetic_run.py /tmp/big --steps 10000 --per-step 100   # 1,000,000 trajectories

settings.json, scripts/ (an env edited twice, so there are diffs), metrics.jsonl with the trainer's
keys, events.jsonl (a checkpoint every 10 steps, a validation every 50, the swaps, a recorded
grad-norm spike), and rollouts/step-N.jsonl with `--per-step` two-turn Sokoban-like trajectories
(8 episodes per group). Deterministic; numbers are made up, shapes are real. tb/ is not written
(`ragen-lab view RUN` writes it from metrics.jsonl).
"""
import argparse
import json
import os

ENV_V1 = "// sokoban\nfn reset(seed) {\n    #{ pos: 0, seed: seed }\n}\nfn step(state, action) {\n    state.pos += 1;\n    state\n}\n"
VERSIONS = [("a1b2c3d4e5f60718", ENV_V1), ("9f8e7d6c5b4a3921", ENV_V1.replace("+= 1", "+= 2")),
            ("0123456789abcdef", ENV_V1.replace("+= 1", "+= 3").replace("// sokoban", "// sokoban, faster"))]
GRID = "#####\\n#P_O#\\n#__X#\\n#####"


def wobble(step, k):
    return ((step * 2654435761 + k * 40503) % 1000) / 500.0 - 1.0


def metrics(step, steps):
    t = step / steps
    m = {"step": step, "time": 1_767_000_000.0 + 7.5 * step,
         "rollout/reward_mean": 0.1 + 0.6 * t + 0.03 * wobble(step, 3), "rollout/reward_std": 0.4 + 0.03 * wobble(step, 4),
         "rollout/reward_min": -0.5, "rollout/reward_max": 1.0, "rollout/success": min(1.0, 0.15 + 0.6 * t),
         "rollout/in_group_std": 0.35 + 0.04 * wobble(step, 1), "rollout/in_group_std_kept": 0.45 + 0.04 * wobble(step, 1),
         "rollout/kept_ratio": 0.25, "rollout/response_len": 48.0 - 10 * t, "rollout/think_len": 30.0 - 8 * t,
         "rollout/turns_mean": 2.0, "rollout/valid_action_rate": 0.9, "rollout/format_error_rate": 0.02,
         "rollout/repetition": 0.05, "rollout/policy_lag": 1,
         "update/entropy": 1.4 - 0.3 * t + 0.02 * wobble(step, 5), "update/grad_norm": 14.0 if step == steps // 2 else 1.1 + 0.3 * wobble(step, 2),
         "update/kl": 0.001 * t, "update/approx_kl": 0.0005, "update/clip_frac": 0.05 + 0.02 * wobble(step, 6),
         "update/pg_loss": -0.01, "update/value_loss": 0.2, "update/lr": 1e-6, "update/optimizer_steps": 4,
         "time/rollout_s": 5.0, "time/update_s": 2.5, "time/step_s": 7.5, "time/prefill_s": 1.0, "time/decode_s": 3.5,
         "time/env_s": 0.5, "perf/tokens": 60000, "perf/flops": 3.1e15, "perf/peak_rss_mb": 9000.0}
    if step % 50 == 0:
        m["val/success"] = 0.1 + 0.7 * t
    if step == steps // 2:
        m["alarms"] = [{"kind": "grad_norm_spike", "since": step,
                        "message": f"grad_norm_spike: gradient norm 14.0000 is 12.7× its running median 1.1000 (threshold 5.0×) (since step {step})"}]
    return m


def trajectory(step, group, episode, version):
    success = (step + group + episode) % 3 == 0
    think = f"step {step}: the box is right of me and the target below it, so I push right first."
    turn = ('{{"user":"Turn {k}:\\nState:\\n{grid}\\nYou have 2 actions left.","obs":"{grid}",'
            '"response":"<think>{think}</think><answer>Right</answer>","think":"{think}","answer":"Right",'
            '"actions":["Right"],"invalid_actions":[],"format_ok":true,"env_reward":-0.1,"reward":-0.1,"done":{done}}}')
    turns = ",".join(turn.format(k=k, grid=GRID, think=think, done="true" if k == 2 else "false") for k in (1, 2))
    score = 0.9 if success else -0.3
    adv = 0.8 if success else -0.6
    return (f'{{"step":{step},"group":{group},"episode":{episode},"seed":{10000 + step * 10 + group},'
            f'"success":{"true" if success else "false"},"score":{score},"normalized_score":{adv},"advantage":{adv},'
            f'"kept":{"true" if group % 4 == 0 else "false"},"response_tokens":57,"policy_version":{step - 1},'
            f'"versions":{{"env":"{version}","prompt":"0c1d2e3f40516273","rewards":["77aa88bb99cc00dd"]}},'
            f'"system":"You\'re a helpful assistant. ","turns":[{turns}]}}\n')


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--per-step", type=int, default=100, help="trajectories per step (8 per group)")
    a = ap.parse_args()
    for sub in ["scripts", "rollouts", "checkpoints"]:
        os.makedirs(os.path.join(a.dir, sub), exist_ok=True)
    settings = {"settings": {"train": {"steps": a.steps}, "echo": {}}, "experiment": "scripts/sokoban.rhai", "model": "synthetic"}
    with open(os.path.join(a.dir, "settings.json"), "w") as f:
        json.dump(settings, f, indent=2)
    swaps = [1, a.steps // 3, 2 * a.steps // 3]
    with open(os.path.join(a.dir, "scripts", "index.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "role": "prompt", "path": "prompts/default.rhai", "hash": "0c1d2e3f40516273"}) + "\n")
        for at, (h, src) in zip(swaps, VERSIONS):
            f.write(json.dumps({"step": at, "role": "env", "path": "envs/sokoban.rhai", "hash": h}) + "\n")
            with open(os.path.join(a.dir, "scripts", h + ".rhai"), "w") as s:
                s.write(src)
    with open(os.path.join(a.dir, "metrics.jsonl"), "w") as m, open(os.path.join(a.dir, "events.jsonl"), "w") as e:
        for step in range(1, a.steps + 1):
            line = metrics(step, a.steps)
            m.write(json.dumps(line) + "\n")
            if step in swaps[1:]:
                i = swaps.index(step)
                e.write(json.dumps({"step": step, "time": line["time"], "kind": "swap",
                                    "message": f"envs/sokoban.rhai {VERSIONS[i - 1][0][:8]} -> {VERSIONS[i][0][:8]}"}) + "\n")
            if "alarms" in line:
                al = line["alarms"][0]
                e.write(json.dumps({"step": step, "time": line["time"], "kind": "alarm", "alarm": al["kind"], "since": step,
                                    "message": al["message"]}) + "\n")
            if step % 50 == 0:
                e.write(json.dumps({"step": step, "time": line["time"], "kind": "validation", "message": "val success",
                                    "val/success": line["val/success"]}) + "\n")
            if step % 10 == 0:
                e.write(json.dumps({"step": step, "time": line["time"], "kind": "checkpoint",
                                    "message": f"saved checkpoints/step-{step:06}"}) + "\n")
    for step in range(1, a.steps + 1):
        version = VERSIONS[sum(step >= s for s in swaps) - 1][0]
        lines = [trajectory(step, n // 8, n % 8, version) for n in range(a.per_step)]
        with open(os.path.join(a.dir, "rollouts", f"step-{step:06}.jsonl"), "w") as f:
            f.writelines(lines)


if __name__ == "__main__":
    main()
