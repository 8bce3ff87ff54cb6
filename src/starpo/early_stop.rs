//! RAGEN-2's three early stops (`agent_trainer.fit`), as settings: off by default here, since a
//! run's Echo-Trap alarms only warn. Each stop is a [`Stopped`] with the numbers that tripped it;
//! the trainer records it as an `early_stop` event, checkpoints and ends the run.
//!
//! 1. Empty filtered batches: the filter kept no group for `empty_steps` steps in a row.
//! 2. Reward-variance collapse: the mean in-group reward std of the first `std_steps` steps that
//!    trained is the baseline; the run stops when the next `std_steps` such steps in a row all
//!    fall under `std_fraction` × baseline (RAGEN-2: 10 steps, 0.1).
//! 3. Validation floor: `val/success` under `val_floor` for `val_count` validations in a row
//!    (RAGEN-2: 0.01, 5).
//!
//! And one of ours, on by default: every group scored alike (no reward variance anywhere, so
//! StarPO skips the update) for `flat_steps` steps in a row. The run has nothing left to learn
//! from: it ends as `solved` when the episodes succeed, else as `no_variance`, saying what to
//! try. A step where one answer is nearly every answer whatever the observation counts as flat
//! too (it ends as `one_answer`): hot sampling leaves such a policy a few differing episodes,
//! too few to learn from, so the streak would otherwise never complete. With
//! `explore_temperature` set a flat run first samples hotter (the policy collapsed onto one
//! outcome, so widen what it tries) and stops only when flat still at that temperature. A run
//! whose validation succeeds `solved_vals` times in a row also ends as `solved`: sampled hot
//! (`rollout.answer_temperature`), a solved policy still errs now and then in training, so its
//! steps are never all flat.
use serde_json::{json, Map, Value};

settings_section! {
    /// RAGEN-2's early stops; each is off at 0.
    Stop {
        /// Stop after this many steps in a row whose filter kept nothing (RAGEN-2: 10); 0 = off.
        empty_steps: usize = 0,
        /// Reward-variance collapse window n (RAGEN-2: 10): the baseline is the mean in-group std
        /// of the first n steps that trained, and n later steps in a row under the fraction stop
        /// the run; 0 = off.
        std_steps: usize = 0,
        /// The share of the baseline std under which a step counts as collapsed.
        std_fraction: f64 = 0.1,
        /// Stop after this many validations in a row with success under `val_floor`
        /// (RAGEN-2: 5); 0 = off.
        val_count: usize = 0,
        /// The validation success floor.
        val_floor: f64 = 0.01,
        /// Stop after this many steps in a row in which every group's episodes scored alike
        /// (nothing to learn from); 0 = off.
        flat_steps: usize = 5,
        /// A step also counts as flat when one answer is at least this share of the answers over
        /// distinct observations (rollout/answer_top_share): a policy that answers alike whatever
        /// it sees samples the other answers too rarely to learn from them, and such a run stops
        /// as `one_answer`; 0 = off. Sampled at rollout.answer_temperature 2, a choice made 99%
        /// of the time at temperature 1 shows as 91% (the learning envs peaked at 84% while
        /// learning).
        one_answer_share: f64 = 0.9,
        /// Such a run is `solved` when the last flat step's success rate reaches this.
        solved_success: f64 = 0.95,
        /// Stop as `solved` after this many validations in a row whose success reaches
        /// `solved_success`; 0 = off.
        solved_vals: usize = 2,
        /// A flat run that is not solved first explores: each flat streak raises
        /// rollout.temperature 1.5× up to this, and only a streak at this temperature stops it
        /// as `no_variance`; at or under rollout.temperature, off (the default: on a collapsed
        /// elevator run, 1.5 and 2.0 brought back one update in 13 steps, docs/training.md).
        explore_temperature: f64 = 0.0,
    }
}

/// Why a run stopped early, with its numbers (the event's fields).
#[derive(Debug, Clone, PartialEq)]
pub struct Stopped {
    /// `empty_filtered_steps`, `reward_variance_collapse` or `low_validation_success`
    /// (RAGEN-2's `early_stop_type`).
    pub kind: &'static str,
    pub message: String,
    pub fields: Map<String, Value>,
}

/// A flat, unsolved run's next sampling temperature (`stop.explore_temperature`), where it
/// may still explore from `temperature`.
pub fn explore_temperature(s: &Stop, temperature: f64) -> Option<f64> {
    let next = (temperature * 1.5).min(s.explore_temperature);
    (next > temperature).then_some(next)
}

/// The stops' running state, fed once per step and once per validation.
#[derive(Debug, Default)]
pub struct EarlyStop {
    empty_run: usize,
    early_stds: Vec<f64>,
    low_stds: Vec<f64>,
    low_vals: Vec<f64>,
    high_vals: Vec<f64>,
    flat_run: usize,
}

impl EarlyStop {
    /// One step: whether its filter kept nothing, and the mean in-group reward std of all its
    /// groups (only steps that kept something count toward the std stop, as in RAGEN-2).
    pub fn step(&mut self, s: &Stop, kept_nothing: bool, in_group_std: f64) -> Option<Stopped> {
        if kept_nothing {
            self.empty_run += 1;
            if s.empty_steps > 0 && self.empty_run >= s.empty_steps {
                let n = self.empty_run;
                return Some(Stopped {
                    kind: "empty_filtered_steps",
                    message: format!(
                        "the filter kept no group for {n} steps in a row (stop.empty_steps = {})",
                        s.empty_steps
                    ),
                    fields: fields(&[("steps", json!(n))]),
                });
            }
            return None;
        }
        self.empty_run = 0;
        if s.std_steps == 0 {
            return None;
        }
        if self.early_stds.len() < s.std_steps {
            self.early_stds.push(in_group_std);
            return None;
        }
        let base = self.early_stds.iter().sum::<f64>() / self.early_stds.len() as f64;
        let floor = s.std_fraction * base;
        if in_group_std < floor {
            self.low_stds.push(in_group_std);
        } else {
            self.low_stds.clear();
        }
        (self.low_stds.len() >= s.std_steps).then(|| Stopped {
            kind: "reward_variance_collapse",
            message: format!(
                "in-group reward std under {:.4} ({} × the early mean {base:.4}) for {} steps in a row: {:?}",
                floor,
                s.std_fraction,
                self.low_stds.len(),
                self.low_stds.iter().map(|v| (v * 1e4).round() / 1e4).collect::<Vec<_>>()
            ),
            fields: fields(&[
                ("baseline_std", json!(base)),
                ("floor", json!(floor)),
                ("recent_std", json!(self.low_stds)),
            ]),
        })
    }

    /// Count flat steps afresh (after the run reacted to a flat streak).
    pub fn reset_flat(&mut self) {
        self.flat_run = 0;
    }

    /// One step's flatness: the mean in-group reward std over all its groups, its success rate,
    /// mean reward and most common answer's share (where measured).
    pub fn flat(
        &mut self,
        s: &Stop,
        in_group_std: f64,
        success: f64,
        reward: f64,
        top_share: Option<f64>,
    ) -> Option<Stopped> {
        let one_answer = top_share.filter(|&x| s.one_answer_share > 0.0 && x >= s.one_answer_share);
        self.flat_run = if in_group_std < 1e-9 || one_answer.is_some() { self.flat_run + 1 } else { 0 };
        if s.flat_steps == 0 || self.flat_run < s.flat_steps {
            return None;
        }
        let n = self.flat_run;
        let numbers = fields(&[("steps", json!(n)), ("success", json!(success)), ("reward_mean", json!(reward))]);
        let remedy = "resume from an earlier checkpoint with a lower optim.lr, a higher rollout.answer_temperature \
                      (rollout.temperature for free text) or a larger rollout.group_size";
        Some(if success >= s.solved_success {
            Stopped {
                kind: "solved",
                message: format!(
                    "solved: every episode of every group scored the same for {n} steps in a row at success \
                     {success:.2} (stop.flat_steps = {})",
                    s.flat_steps
                ),
                fields: numbers,
            }
        } else if let Some(share) = one_answer {
            let mut numbers = numbers;
            numbers.insert("answer_top_share".into(), json!(share));
            Stopped {
                kind: "one_answer",
                message: format!(
                    "collapsed: {:.0}% of the answers are one answer whatever the observation (success \
                     {success:.2}, reward {reward:.3}), and {n} steps in a row were like it or flat: the \
                     policy samples the others too rarely to learn from them. Where a blind answer pays, \
                     settling on it is what StarPO optimises (the Echo Trap): reward progress in the env so \
                     that it pays less, or {remedy} (stop.flat_steps = {}, stop.one_answer_share = {})",
                    share * 100.0,
                    s.flat_steps,
                    s.one_answer_share
                ),
                fields: numbers,
            }
        } else {
            Stopped {
                kind: "no_variance",
                message: format!(
                    "no group's episodes scored differently for {n} steps in a row (success {success:.2}, \
                     reward {reward:.3}): StarPO has nothing left to learn from. The policy gives the same \
                     outcome every time: {remedy} (stop.flat_steps = {})",
                    s.flat_steps
                ),
                fields: numbers,
            }
        })
    }

    /// One validation's success rate.
    pub fn validation(&mut self, s: &Stop, success: f64) -> Option<Stopped> {
        if success >= s.solved_success {
            self.high_vals.push(success);
        } else {
            self.high_vals.clear();
        }
        if s.solved_vals > 0 && self.high_vals.len() >= s.solved_vals {
            return Some(Stopped {
                kind: "solved",
                message: format!(
                    "solved: validation success reached {} for {} validations in a row: {:?} (stop.solved_vals = {})",
                    s.solved_success,
                    self.high_vals.len(),
                    self.high_vals,
                    s.solved_vals
                ),
                fields: fields(&[
                    ("validations", json!(self.high_vals.len())),
                    ("recent_success", json!(self.high_vals)),
                ]),
            });
        }
        if success < s.val_floor {
            self.low_vals.push(success);
        } else {
            self.low_vals.clear();
        }
        (s.val_count > 0 && self.low_vals.len() >= s.val_count).then(|| Stopped {
            kind: "low_validation_success",
            message: format!(
                "validation success under {} for {} validations in a row: {:?}",
                s.val_floor,
                self.low_vals.len(),
                self.low_vals
            ),
            fields: fields(&[("floor", json!(s.val_floor)), ("recent_success", json!(self.low_vals))]),
        })
    }
}

fn fields(kv: &[(&str, Value)]) -> Map<String, Value> {
    kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on() -> Stop {
        Stop { empty_steps: 2, std_steps: 2, std_fraction: 0.1, val_count: 2, val_floor: 0.01, ..Stop::default() }
    }

    #[test]
    fn empty_steps_stop_only_when_consecutive() {
        let (s, mut e) = (on(), EarlyStop::default());
        assert!(e.step(&s, true, 0.0).is_none());
        assert!(e.step(&s, false, 0.5).is_none(), "a kept step resets the count");
        assert!(e.step(&s, true, 0.0).is_none());
        let stop = e.step(&s, true, 0.0).unwrap();
        assert_eq!((stop.kind, stop.fields["steps"].clone()), ("empty_filtered_steps", json!(2)));
    }

    #[test]
    fn std_collapse_against_the_early_mean() {
        // Baseline from the first two steps: (0.4 + 0.6)/2 = 0.5, floor 0.05. Then 0.04 (low),
        // 0.2 (resets), 0.01, 0.049 → two low steps in a row: stop.
        let (s, mut e) = (on(), EarlyStop::default());
        for std in [0.4, 0.6, 0.04, 0.2, 0.01] {
            assert!(e.step(&s, false, std).is_none(), "{std}");
        }
        assert!(e.step(&s, true, 0.0).is_none(), "empty steps do not count toward the std stop");
        let stop = e.step(&s, false, 0.049).unwrap();
        assert_eq!(stop.kind, "reward_variance_collapse");
        assert!((stop.fields["baseline_std"].as_f64().unwrap() - 0.5).abs() < 1e-12);
        assert_eq!(stop.fields["recent_std"], json!([0.01, 0.049]));
    }

    #[test]
    fn validation_floor_and_off_by_default() {
        let (s, mut e) = (on(), EarlyStop::default());
        assert!(e.validation(&s, 0.0).is_none());
        assert!(e.validation(&s, 0.5).is_none());
        assert!(e.validation(&s, 0.005).is_none());
        assert_eq!(e.validation(&s, 0.0).unwrap().kind, "low_validation_success");
        let (off, mut e) = (Stop { flat_steps: 0, ..Stop::default() }, EarlyStop::default());
        for _ in 0..50 {
            assert!(e.step(&off, true, 0.0).is_none() && e.validation(&off, 0.0).is_none());
            assert!(e.flat(&off, 0.0, 0.0, 0.0, Some(1.0)).is_none());
        }
    }

    #[test]
    fn validations_at_the_solved_success_in_a_row_end_the_run_as_solved() {
        let (s, mut e) = (Stop::default(), EarlyStop::default());
        assert!(e.validation(&s, 0.97).is_none());
        assert!(e.validation(&s, 0.90).is_none(), "one under the bar resets the count");
        assert!(e.validation(&s, 1.0).is_none());
        let stop = e.validation(&s, 0.96).expect("two in a row");
        assert_eq!((stop.kind, stop.fields["validations"].clone()), ("solved", json!(2)));
        let (off, mut e) = (Stop { solved_vals: 0, ..Stop::default() }, EarlyStop::default());
        assert!((0..5).all(|_| e.validation(&off, 1.0).is_none()));
    }

    #[test]
    fn a_flat_run_explores_up_to_the_cap() {
        let s = Stop { explore_temperature: 2.0, ..Stop::default() };
        assert_eq!(explore_temperature(&s, 1.0), Some(1.5));
        assert_eq!(explore_temperature(&s, 1.5), Some(2.0));
        assert_eq!(explore_temperature(&s, 2.0), None);
        assert_eq!(explore_temperature(&Stop { explore_temperature: 0.0, ..s }, 1.0), None, "off");
    }

    #[test]
    fn flat_runs_end_as_solved_or_as_no_variance_and_variance_resets_them() {
        let s = Stop { flat_steps: 3, ..Stop::default() };
        let mut e = EarlyStop::default();
        assert!(e.flat(&s, 0.0, 1.0, 1.0, None).is_none());
        assert!(e.flat(&s, 0.0, 1.0, 1.0, None).is_none());
        assert!(e.flat(&s, 0.2, 0.5, 0.5, Some(0.6)).is_none(), "a step with variance resets the count");
        assert!(e.flat(&s, 0.0, 1.0, 1.0, None).is_none() && e.flat(&s, 1e-17, 1.0, 1.0, None).is_none());
        let stop = e.flat(&s, 0.0, 1.0, 1.0, None).unwrap();
        assert_eq!((stop.kind, stop.fields["steps"].clone()), ("solved", json!(3)));
        let mut e = EarlyStop::default();
        let stop = (0..3).filter_map(|_| e.flat(&s, 0.0, 0.19, 0.4, None)).next().unwrap();
        assert_eq!(stop.kind, "no_variance");
        assert!(stop.message.contains("success 0.19") && stop.message.contains("optim.lr"), "{}", stop.message);
    }

    #[test]
    fn one_answer_to_every_observation_counts_as_flat_and_ends_as_one_answer() {
        // Elevator's collapse (docs/training.md): "Up" to every floor, the odd hot sample still
        // scoring differently (std 0.06), a flat step between.
        let s = Stop { flat_steps: 3, ..Stop::default() };
        let mut e = EarlyStop::default();
        assert!(e.flat(&s, 0.06, 0.47, 0.47, Some(0.99)).is_none());
        assert!(e.flat(&s, 0.0, 0.5, 0.5, Some(1.0)).is_none());
        let stop = e.flat(&s, 0.06, 0.34, 0.34, Some(0.96)).unwrap();
        assert_eq!((stop.kind, stop.fields["answer_top_share"].clone()), ("one_answer", json!(0.96)));
        assert!(stop.message.contains("96%") && stop.message.contains("optim.lr"), "{}", stop.message);
        // Under the share, answers that follow the observation reset the count; off at 0.
        let mut e = EarlyStop::default();
        assert!([0.99, 0.85, 0.99, 0.99].iter().all(|&x| e.flat(&s, 0.06, 0.5, 0.5, Some(x)).is_none()));
        let off = Stop { one_answer_share: 0.0, ..s };
        assert!((0..5).all(|_| e.flat(&off, 0.06, 0.5, 0.5, Some(1.0)).is_none()));
        // A solved policy may answer alike when one answer is right everywhere.
        let mut e = EarlyStop::default();
        let stop = (0..3).filter_map(|_| e.flat(&s, 0.0, 1.0, 1.0, Some(1.0))).next().unwrap();
        assert_eq!(stop.kind, "solved");
    }
}
