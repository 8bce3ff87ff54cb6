//! Constrained answers (`rollout.constrain_actions`): inside `<answer>`, only tokens that keep
//! the answer a prefix of a well-formed action list may be sampled — `A`, `A || B`, … (at most
//! k of the env's action names as the env spells them), then `</answer>`, written exactly as the
//! history re-serialises an answer (`ParsedTurn::reserialize`): what was sampled is what the
//! next turn shows and what the update trains, and episodes that chose alike share their
//! history token for token. A misspelt or invented action cannot happen; which action to take
//! is still the model's choice. Off by default: RAGEN samples freely.
//!
//! The check runs on text, not token ids, so every tokenisation of an action is allowed: the
//! answer so far is run through a small automaton, and a token is allowed when the automaton
//! survives its text. Tokens whose text is empty (special tokens) or not ASCII are never
//! allowed inside an answer.

/// The language of one answer: `A (" || " A){0,k-1} "</answer>"`, the canonical form.
#[derive(Clone, Debug, PartialEq)]
pub struct AnswerGrammar {
    /// Action names, as the env spells them.
    actions: Vec<Vec<u8>>,
    /// Most actions in one answer.
    max_actions: usize,
    /// The generation starts inside `<answer>` (no-think mode); otherwise the answer starts
    /// after the first `<answer>` the model writes.
    starts_inside: bool,
}

const CLOSE: &[u8] = b"</answer>";
const OPEN: &str = "<answer>";
const SEP: &[u8] = b" || ";

/// Where the automaton is; `done` counts the actions completed so far.
#[derive(Clone, Copy, Debug, PartialEq)]
enum At {
    /// Before an action.
    Before { done: usize },
    /// `len` bytes into action `a`.
    In { done: usize, a: usize, len: usize },
    /// After an action: ` || ` or `</answer>`.
    After { done: usize },
    /// `len` bytes into ` || `.
    Sep { done: usize, len: usize },
    /// `len` bytes into `</answer>`.
    Close { len: usize },
    /// The answer is complete; nothing may follow.
    End,
}

impl AnswerGrammar {
    /// `None` when there is nothing to constrain to (a free-text env).
    pub fn new(actions: &[String], max_actions: usize, starts_inside: bool) -> Option<Self> {
        let actions: Vec<Vec<u8>> = actions.iter().filter(|a| !a.is_empty()).map(|a| a.as_bytes().to_vec()).collect();
        (!actions.is_empty()).then_some(Self { actions, max_actions: max_actions.max(1), starts_inside })
    }

    /// What it was built from: (action names, most actions per answer, starts inside), to send
    /// to an engine that builds its own (`answer_grammar` of `ragen-lab serve`).
    pub fn parts(&self) -> (Vec<String>, usize, bool) {
        let names = self.actions.iter().map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        (names, self.max_actions, self.starts_inside)
    }

    /// The part of a reply the grammar governs: all of it in no-think mode, else what follows
    /// the first `<answer>`; `None` while the reply is still outside the answer.
    pub fn answer_part<'a>(&self, reply: &'a str) -> Option<&'a str> {
        if self.starts_inside {
            return Some(reply);
        }
        reply.find(OPEN).map(|i| &reply[i + OPEN.len()..])
    }

    /// The states after `text`, from the start of an answer (empty: `text` is not a prefix).
    fn run(&self, text: &[u8]) -> Vec<At> {
        text.iter().fold(vec![At::Before { done: 0 }], |states, &c| self.step(&states, c))
    }

    fn step(&self, states: &[At], c: u8) -> Vec<At> {
        let mut next = Vec::new();
        let mut push = |s: At| {
            if !next.contains(&s) {
                next.push(s);
            }
        };
        for &s in states {
            match s {
                At::Before { done } => {
                    for (a, name) in self.actions.iter().enumerate() {
                        if name[0] == c {
                            push(self.advance(done, a, 1));
                        }
                    }
                }
                At::In { done, a, len } => {
                    if self.actions[a][len] == c {
                        push(self.advance(done, a, len + 1));
                    }
                }
                At::After { done } => {
                    if c == SEP[0] && done < self.max_actions {
                        push(At::Sep { done, len: 1 });
                    } else if c == CLOSE[0] {
                        push(At::Close { len: 1 });
                    }
                }
                At::Sep { done, len } => {
                    if SEP[len] == c {
                        push(if len + 1 == SEP.len() {
                            At::Before { done }
                        } else {
                            At::Sep { done, len: len + 1 }
                        });
                    }
                }
                At::Close { len } => {
                    if CLOSE[len] == c {
                        push(if len + 1 == CLOSE.len() { At::End } else { At::Close { len: len + 1 } });
                    }
                }
                At::End => {}
            }
        }
        next
    }

    /// `len` bytes into action `a`, or past it when that is all of it.
    fn advance(&self, done: usize, a: usize, len: usize) -> At {
        if len == self.actions[a].len() {
            At::After { done: done + 1 }
        } else {
            At::In { done, a, len }
        }
    }

    /// Whether `answer + more` is still a prefix of a well-formed answer.
    pub fn allows(&self, answer: &str, more: &str) -> bool {
        let states = self.run(answer.as_bytes());
        !more.is_empty() && !more.bytes().fold(states, |s, c| self.step(&s, c)).is_empty()
    }

    /// Per token id, whether it may follow `answer` (`token_texts[id]`: the token's text alone).
    /// `None` when `answer` itself is off the grammar (the opening token carried other text):
    /// the row is then left unconstrained rather than stuck.
    pub fn allowed_tokens(&self, answer: &str, token_texts: &[String]) -> Option<Vec<bool>> {
        let states = self.run(answer.as_bytes());
        if states.is_empty() {
            return None;
        }
        // Bytes that can come next, to reject most of the vocabulary at its first byte.
        let mut first = [false; 256];
        for c in 0..=255u8 {
            first[c as usize] = !self.step(&states, c).is_empty();
        }
        let allowed: Vec<bool> = token_texts
            .iter()
            .map(|t| {
                let b = t.as_bytes();
                !b.is_empty()
                    && first[b[0] as usize]
                    && !b.iter().fold(states.clone(), |s, &c| self.step(&s, c)).is_empty()
            })
            .collect();
        allowed.contains(&true).then_some(allowed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grammar(k: usize) -> AnswerGrammar {
        AnswerGrammar::new(&["Up".into(), "Down".into(), "Upper".into()], k, true).unwrap()
    }

    #[test]
    fn well_formed_answers_and_their_prefixes_pass_and_nothing_else() {
        let g = grammar(2);
        for ok in ["Up</answer>", "Up || Down</answer>", "Upper || Up</answer>", "Down</answer>"] {
            for cut in 1..=ok.len() {
                assert!(g.allows("", &ok[..cut]), "{:?}", &ok[..cut]);
            }
        }
        for bad in [
            "Upp ",
            "Up || Down || Up",
            " Up",
            "Up </answer>",
            "Up||Down",
            "[your answer]",
            "Lef",
            "Up </answer> ",
            "||",
            "Up |x",
            "",
            "up",
            "  Up",
            "Up\n",
            "Up </Answer>",
        ] {
            assert!(!g.allows("", bad), "{bad:?}");
        }
        assert!(g.allows("Up ||", " Do") && !g.allows("Up ||", " Dx") && !g.allows("Up ||", "Do"));
        assert!(AnswerGrammar::new(&[], 2, true).is_none(), "free text cannot be constrained");
    }

    #[test]
    fn token_masks_follow_the_text_and_think_mode_waits_for_the_answer() {
        let g = grammar(1);
        let texts: Vec<String> =
            ["", "U", "p", "pper", "Down", "</answer>", "</", " ||", "x", "<|im_end|>", " Up"].map(String::from).to_vec();
        let m = g.allowed_tokens("", &texts).unwrap();
        assert_eq!(m, [false, true, false, false, true, false, false, false, false, false, false]);
        let m = g.allowed_tokens("U", &texts).unwrap();
        assert_eq!(m, [false, false, true, true, false, false, false, false, false, false, false]);
        // One action at most: after it only the closing tag.
        let m = g.allowed_tokens("Up", &texts).unwrap();
        assert_eq!(m, [false, false, true, false, false, true, true, false, false, false, false]);
        let two = grammar(2).allowed_tokens("Up", &texts).unwrap();
        assert!(two[7] && two[5] && !two[10], "then ` ||` or the closing tag");
        assert_eq!(g.allowed_tokens("nonsense", &texts), None);
        let think = AnswerGrammar::new(&["Up".into()], 1, false).unwrap();
        assert_eq!(think.answer_part("I go up </think>"), None);
        assert_eq!(think.answer_part("I go up </think><answer>U"), Some("U"));
    }
}
