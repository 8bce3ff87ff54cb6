//! Constrained answers (`rollout.constrain_actions`): inside `<answer>`, only tokens that keep
//! the answer a prefix of a well-formed action list may be sampled — `A`, `A || B`, … (at most
//! k of the env's action names as the env spells them), then `</answer>`, written exactly as the
//! history re-serialises an answer (`ParsedTurn::reserialize`): what was sampled is what the
//! next turn shows and what the update trains, and episodes that chose alike share their
//! history token for token. A misspelt or invented action cannot happen; which action to take
//! is still the model's choice. Off by default: RAGEN samples freely.
//!
//! Two automata read the answer so far. Over token ids (the tokenizer's own,
//! [`AnswerGrammar::with_tokens`]): each piece of text in its canonical ids, so one spelling, and a
//! value slot (`extract total={money}`) as any tokens that spell a value of its shape. Over text
//! (the fallback where a piece does not round-trip through the tokenizer): any token whose text
//! keeps the automaton alive. Tokens whose text is empty (special tokens) or not ASCII are never
//! allowed inside an answer.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::script::pattern::{self, Item, Part, Pos, Sym};

/// The language of one answer: `A (" || " A){0,k-1} "</answer>"`, the canonical form, over
/// text; and, once [`AnswerGrammar::with_tokens`] has tokenised its pieces, over token ids: each
/// piece (an action name, ` || `, `</answer>`) as its own canonical tokens, so identical answers
/// are identical ids and a choice between actions is a choice between their first tokens. An
/// action with value slots (`extract total={money}`, [`pattern`]) has its text in canonical ids
/// too and its value as any tokens that spell a value of the shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AnswerGrammar {
    names: Vec<String>,
    text: Pieces,
    tokens: Option<TokenPieces>,
    /// Most actions in one answer.
    max_actions: usize,
    /// The generation starts inside `<answer>` (no-think mode); otherwise the answer starts
    /// after the first `<answer>` the model writes.
    starts_inside: bool,
}

const CLOSE: &str = "</answer>";
const OPEN: &str = "<answer>";
const SEP: &str = " || ";

/// An answer's pieces over text.
#[derive(Clone, Debug, PartialEq)]
struct Pieces {
    actions: Vec<Vec<Item>>,
    sep: Vec<u8>,
    close: Vec<u8>,
}

/// Where the automaton is; `done` counts the actions completed so far.
#[derive(Clone, Copy, Debug, PartialEq)]
enum At {
    /// Before an action.
    Before { done: usize },
    /// Inside action `a`, at `at` of its pattern.
    In { done: usize, a: usize, at: Pos },
    /// After an action: ` || ` or `</answer>`.
    After { done: usize },
    /// `len` symbols into ` || `.
    Sep { done: usize, len: usize },
    /// `len` symbols into `</answer>`.
    Close { len: usize },
    /// The answer is complete; nothing may follow.
    End,
}

impl Pieces {
    /// The states after `text`, from the start of an answer (empty: `text` is not a prefix).
    fn run(&self, max: usize, text: &[u8]) -> Vec<At> {
        text.iter().fold(vec![At::Before { done: 0 }], |states, &c| self.step(max, &states, c))
    }

    /// Each state's successors: the symbol that may come next and where it leads.
    fn moves(&self, max: usize, s: At) -> Vec<(Sym, At)> {
        let is = Sym::Is;
        match s {
            At::Before { done } => (0..self.actions.len())
                .flat_map(|a| self.moves(max, At::In { done, a, at: Pos { item: 0, count: 0 } }))
                .collect(),
            At::In { done, a, at } => {
                let mut m = Vec::new();
                let may_end = pattern::moves(&self.actions[a], at, &mut m);
                let after = At::After { done: done + 1 };
                let mut out: Vec<_> =
                    m.into_iter().map(|(x, to)| (x, to.map_or(after, |at| At::In { done, a, at }))).collect();
                if may_end {
                    out.extend(self.moves(max, after));
                }
                out
            }
            At::After { done } => {
                let mut m = vec![(is(self.close[0]), self.closing(1))];
                if done < max {
                    m.push((is(self.sep[0]), self.separating(done, 1)));
                }
                m
            }
            At::Sep { done, len } => vec![(is(self.sep[len]), self.separating(done, len + 1))],
            At::Close { len } => vec![(is(self.close[len]), self.closing(len + 1))],
            At::End => vec![],
        }
    }

    fn step(&self, max: usize, states: &[At], c: u8) -> Vec<At> {
        let mut next = Vec::new();
        for (_, to) in states.iter().flat_map(|&s| self.moves(max, s)).filter(|(x, _)| x.accepts(c)) {
            if !next.contains(&to) {
                next.push(to);
            }
        }
        next
    }

    /// The symbols that may come next.
    fn next(&self, max: usize, states: &[At]) -> Vec<Sym> {
        let mut out = Vec::new();
        for (x, _) in states.iter().flat_map(|&s| self.moves(max, s)) {
            if !out.contains(&x) {
                out.push(x);
            }
        }
        out
    }

    fn separating(&self, done: usize, len: usize) -> At {
        match len == self.sep.len() {
            true => At::Before { done },
            false => At::Sep { done, len },
        }
    }

    fn closing(&self, len: usize) -> At {
        match len == self.close.len() {
            true => At::End,
            false => At::Close { len },
        }
    }
}

/// A piece of an action over token ids: the canonical ids of text spelt as written, or a slot
/// whose value is any run of tokens that spells a value of its shape, each token wholly inside
/// the value (so the next piece starts on its own canonical ids).
#[derive(Clone, Debug, PartialEq)]
enum Seg {
    Ids(Vec<u32>),
    Slot(Vec<Item>),
}

/// Where the token automaton is (as [`At`], inside an action by segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum TokAt {
    Before {
        done: usize,
    },
    /// `len` ids into action `a`'s segment `seg`.
    Ids {
        done: usize,
        a: usize,
        seg: usize,
        len: usize,
    },
    /// At `at` of action `a`'s slot `seg`.
    Slot {
        done: usize,
        a: usize,
        seg: usize,
        at: Pos,
    },
    After {
        done: usize,
    },
    Sep {
        done: usize,
        len: usize,
    },
    Close {
        len: usize,
    },
    End,
}

/// The answer over token ids: every literal piece in its canonical ids, values over their text.
#[derive(Clone, Debug, Default)]
struct TokenPieces {
    actions: Vec<Vec<Seg>>,
    sep: Vec<u32>,
    close: Vec<u32>,
    /// The tokens that may continue each slot position met so far (one vocabulary scan each).
    slot_tokens: Arc<Mutex<HashMap<TokAt, Arc<[u32]>>>>,
}

impl PartialEq for TokenPieces {
    fn eq(&self, o: &Self) -> bool {
        (&self.actions, &self.sep, &self.close) == (&o.actions, &o.sep, &o.close)
    }
}

impl TokenPieces {
    /// The states `ids` lead to from the start of an answer (empty: off the grammar).
    fn run(&self, max: usize, ids: &[u32], texts: &[String]) -> Vec<TokAt> {
        let mut states = Vec::new();
        self.expand(TokAt::Before { done: 0 }, &mut states);
        for &id in ids {
            states = self.step(max, &states, id, texts);
        }
        states
    }

    /// The state at the start of segment `seg` of action `a`.
    fn start(&self, done: usize, a: usize, seg: usize) -> TokAt {
        match self.actions[a].get(seg) {
            None => TokAt::After { done: done + 1 },
            Some(Seg::Ids(_)) => TokAt::Ids { done, a, seg, len: 0 },
            Some(Seg::Slot(_)) => TokAt::Slot { done, a, seg, at: Pos { item: 0, count: 0 } },
        }
    }

    /// `s` and the states reachable from it without reading a token: every action's start, and
    /// the next segment where a slot's value may end here.
    fn expand(&self, s: TokAt, out: &mut Vec<TokAt>) {
        match s {
            TokAt::Before { done } => (0..self.actions.len()).for_each(|a| self.expand(self.start(done, a, 0), out)),
            TokAt::Slot { done, a, seg, at } => {
                let Seg::Slot(items) = &self.actions[a][seg] else { unreachable!("a slot state is in a slot") };
                let mut m = Vec::new();
                let may_end = pattern::moves(items, at, &mut m);
                if !m.is_empty() && !out.contains(&s) {
                    out.push(s);
                }
                if may_end {
                    self.expand(self.start(done, a, seg + 1), out);
                }
            }
            s if !out.contains(&s) => out.push(s),
            _ => {}
        }
    }

    fn step(&self, max: usize, states: &[TokAt], id: u32, texts: &[String]) -> Vec<TokAt> {
        let mut next = Vec::new();
        for &s in states {
            match s {
                TokAt::Ids { done, a, seg, len } => {
                    let Seg::Ids(ids) = &self.actions[a][seg] else { unreachable!("an ids state is in ids") };
                    if ids[len] == id {
                        let to = if len + 1 == ids.len() {
                            self.start(done, a, seg + 1)
                        } else {
                            TokAt::Ids { done, a, seg, len: len + 1 }
                        };
                        self.expand(to, &mut next);
                    }
                }
                TokAt::Slot { done, a, seg, at } => {
                    let Seg::Slot(items) = &self.actions[a][seg] else { unreachable!("a slot state is in a slot") };
                    let text = texts.get(id as usize).map_or(&[][..], |t| t.as_bytes());
                    if text.is_empty() {
                        continue;
                    }
                    for end in pattern::walk(items, at, text) {
                        let to = match end {
                            Some(at) => TokAt::Slot { done, a, seg, at },
                            None => self.start(done, a, seg + 1),
                        };
                        self.expand(to, &mut next);
                    }
                }
                _ => {
                    if let Some(to) = self.literal_moves(max, s).into_iter().find(|m| m.0 == id).map(|m| m.1) {
                        self.expand(to, &mut next);
                    }
                }
            }
        }
        next
    }

    /// The moves of a state outside the actions: separator and closing tag, id by id.
    fn literal_moves(&self, max: usize, s: TokAt) -> Vec<(u32, TokAt)> {
        let sep = |done, len| if len == self.sep.len() { TokAt::Before { done } } else { TokAt::Sep { done, len } };
        let close = |len| if len == self.close.len() { TokAt::End } else { TokAt::Close { len } };
        match s {
            TokAt::After { done } => {
                let mut m = vec![(self.close[0], close(1))];
                if done < max {
                    m.push((self.sep[0], sep(done, 1)));
                }
                m
            }
            TokAt::Sep { done, len } => vec![(self.sep[len], sep(done, len + 1))],
            TokAt::Close { len } => vec![(self.close[len], close(len + 1))],
            _ => vec![],
        }
    }

    /// The ids that may come next.
    fn next(&self, max: usize, states: &[TokAt], texts: &[String]) -> Vec<u32> {
        let mut out = Vec::new();
        for &s in states {
            match s {
                TokAt::Ids { a, seg, len, .. } => {
                    let Seg::Ids(ids) = &self.actions[a][seg] else { unreachable!("an ids state is in ids") };
                    out.push(ids[len]);
                }
                TokAt::Slot { a, seg, at, .. } => out.extend_from_slice(&self.slot_tokens(s, a, seg, at, texts)),
                _ => out.extend(self.literal_moves(max, s).into_iter().map(|m| m.0)),
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The tokens whose whole text continues slot `seg` of action `a` from `at`.
    fn slot_tokens(&self, key: TokAt, a: usize, seg: usize, at: Pos, texts: &[String]) -> Arc<[u32]> {
        let mut cache = self.slot_tokens.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(key)
            .or_insert_with(|| {
                let Seg::Slot(items) = &self.actions[a][seg] else { unreachable!("a slot state is in a slot") };
                (0..texts.len() as u32)
                    .filter(|&id| {
                        let t = texts[id as usize].as_bytes();
                        !t.is_empty() && !pattern::walk(items, at, t).is_empty()
                    })
                    .collect()
            })
            .clone()
    }
}

impl AnswerGrammar {
    /// `None` when there is nothing to constrain to (a free-text env). An action that is not a
    /// well-formed pattern is taken as a plain name (`check` reports it).
    pub fn new(actions: &[String], max_actions: usize, starts_inside: bool) -> Option<Self> {
        let names: Vec<String> = actions.iter().filter(|a| !a.is_empty()).cloned().collect();
        let items = names.iter().map(|a| pattern::items(a)).collect();
        let text = Pieces { actions: items, sep: SEP.as_bytes().to_vec(), close: CLOSE.as_bytes().to_vec() };
        (!names.is_empty()).then_some(Self {
            names,
            text,
            tokens: None,
            max_actions: max_actions.max(1),
            starts_inside,
        })
    }

    /// The grammar over token ids, each piece of text tokenised by `encode` on its own (an
    /// action's text around its slots, ` || `, `</answer>`); a slot's value stays any tokens
    /// that spell it. Kept over text where a piece does not tokenise to ids that decode back
    /// to it (`decode`).
    pub fn with_tokens(
        mut self,
        encode: impl Fn(&str) -> Option<Vec<u32>>,
        decode: impl Fn(&[u32]) -> Option<String>,
    ) -> Self {
        let piece = |text: &str| -> Option<Vec<u32>> {
            let ids = encode(text).filter(|ids| !ids.is_empty())?;
            (decode(&ids)? == text).then_some(ids)
        };
        let segments = |name: &String| -> Option<Vec<Seg>> {
            let parts = pattern::parts(name).unwrap_or_else(|_| vec![Part::Lit(name.clone())]);
            parts
                .into_iter()
                .map(|p| match p {
                    Part::Lit(t) => piece(&t).map(Seg::Ids),
                    Part::Slot(items) => Some(Seg::Slot(items)),
                })
                .collect()
        };
        let actions: Option<Vec<Vec<Seg>>> = self.names.iter().map(segments).collect();
        self.tokens = match (actions, piece(SEP), piece(CLOSE)) {
            (Some(actions), Some(sep), Some(close)) => Some(TokenPieces { actions, sep, close, ..Default::default() }),
            _ => None,
        };
        self
    }

    /// What it was built from: (action names, most actions per answer, starts inside), to send
    /// to an engine that builds its own (`answer_grammar` of `ragen-lab serve`).
    pub fn parts(&self) -> (Vec<String>, usize, bool) {
        (self.names.clone(), self.max_actions, self.starts_inside)
    }

    /// The part of a reply the grammar governs: all of it in no-think mode, else what follows
    /// the first `<answer>`; `None` while the reply is still outside the answer.
    pub fn answer_part<'a>(&self, reply: &'a str) -> Option<&'a str> {
        if self.starts_inside {
            return Some(reply);
        }
        reply.find(OPEN).map(|i| &reply[i + OPEN.len()..])
    }

    /// Whether the token after `reply` (text and ids as in [`Self::next_tokens`]) continues a
    /// value slot (`{money}`, …). A value is copied from the observation, not chosen among
    /// actions, so it is drawn at the text temperature (`rollout.answer_temperature` tempers
    /// choices only). Over text (the fallback automaton) every position counts as a choice.
    pub fn in_value(&self, reply: &str, ids: &[u32], token_texts: &[String]) -> bool {
        let (Some(answer), Some(tokens)) = (self.answer_part(reply), &self.tokens) else { return false };
        let Some(ids) = answer_ids(reply.len() - answer.len(), ids, token_texts) else { return false };
        tokens.run(self.max_actions, ids, token_texts).iter().any(|s| matches!(s, TokAt::Slot { .. }))
    }

    /// Whether `answer + more` is still a prefix of a well-formed answer (over text).
    pub fn allows(&self, answer: &str, more: &str) -> bool {
        let states = self.text.run(self.max_actions, answer.as_bytes());
        !more.is_empty() && !more.bytes().fold(states, |s, c| self.text.step(self.max_actions, &s, c)).is_empty()
    }

    /// The token ids that may follow a reply so far (`reply`: its text, `ids`: its ids,
    /// `token_texts[id]`: each id's text alone), sorted; `None` where the reply is free: outside
    /// the answer yet, off the grammar (the opening token carried other text: the row is left
    /// unconstrained rather than stuck), or complete.
    pub fn next_tokens(&self, reply: &str, ids: &[u32], token_texts: &[String]) -> Option<Vec<u32>> {
        let answer = self.answer_part(reply)?;
        let mut out = match (&self.tokens, answer_ids(reply.len() - answer.len(), ids, token_texts)) {
            (Some(tokens), Some(ids)) => {
                tokens.next(self.max_actions, &tokens.run(self.max_actions, ids, token_texts), token_texts)
            }
            _ => self.text_tokens(answer, token_texts),
        };
        out.sort_unstable();
        (!out.is_empty()).then_some(out)
    }

    /// Every token whose text keeps `answer` on the grammar (any tokenisation of an answer).
    fn text_tokens(&self, answer: &str, token_texts: &[String]) -> Vec<u32> {
        let (g, max) = (&self.text, self.max_actions);
        let states = g.run(max, answer.as_bytes());
        if states.is_empty() {
            return vec![];
        }
        // Bytes that can come next, to reject most of the vocabulary at its first byte.
        let mut first = [false; 256];
        for x in g.next(max, &states) {
            for b in 0..=255u8 {
                first[b as usize] |= x.accepts(b);
            }
        }
        (0..token_texts.len() as u32)
            .filter(|&id| {
                let b = token_texts[id as usize].as_bytes();
                !b.is_empty()
                    && first[b[0] as usize]
                    && !b.iter().fold(states.clone(), |s, &c| g.step(max, &s, c)).is_empty()
            })
            .collect()
    }
}

/// The ids of a reply from the byte `from` of its text on, where a token starts there.
fn answer_ids<'a>(from: usize, ids: &'a [u32], token_texts: &[String]) -> Option<&'a [u32]> {
    let mut at = 0;
    for (k, &id) in ids.iter().enumerate() {
        if at == from {
            return Some(&ids[k..]);
        }
        at += token_texts.get(id as usize)?.len();
    }
    (at == from).then_some(&[])
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

    fn texts() -> Vec<String> {
        [
            "",
            "U",
            "p",
            "pper",
            "Down",
            "</answer>",
            "</",
            " ||",
            "x",
            "<|im_end|>",
            " Up",
            " ",
            "<answer>",
            "ok",
            "<answe",
            "r>U",
        ]
        .map(String::from)
        .to_vec()
    }

    #[test]
    fn over_text_every_tokenisation_of_an_answer_may_follow() {
        let (g, t) = (grammar(1), texts());
        assert_eq!(g.next_tokens("", &[], &t), Some(vec![1, 4]));
        assert_eq!(g.next_tokens("U", &[1], &t), Some(vec![2, 3]));
        // One action at most: after it only the closing tag (and `Upp…` of Upper).
        assert_eq!(g.next_tokens("Up", &[1, 2], &t), Some(vec![2, 5, 6]));
        assert_eq!(
            grammar(2).next_tokens("Up", &[1, 2], &t),
            Some(vec![2, 5, 6, 7, 11]),
            "then ` ||` or ` `, never ` Up`"
        );
        assert_eq!(g.next_tokens("nonsense", &[8], &t), None, "off the grammar: free");
        assert_eq!(g.next_tokens("Up</answer>", &[1, 2, 5], &t), None, "complete: free");
    }

    /// Over text a value slot admits any tokenisation of a value of its shape, and the closing
    /// tag only once the shape is complete.
    #[test]
    fn a_value_slot_admits_its_shape_and_closes_only_when_complete() {
        let t: Vec<String> = ["", "pay ", "pay", " ", "12", "3", ".", ".5", "0", "</answer>", "x", "1.", "approve"]
            .map(String::from)
            .to_vec();
        let g = AnswerGrammar::new(&["pay {money}".into(), "approve".into()], 1, true)
            .unwrap()
            .with_tokens(|s| Some(vec![s.len() as u32]), |_| Some(String::new()));
        let ids = |text: &str| vec![0u32; text.len().min(1)];
        for (so_far, want) in [
            ("", vec![1, 2, 12]),
            ("pay ", vec![4, 5, 8, 11]),
            ("pay 12", vec![4, 5, 6, 7, 8, 11]),
            ("pay 12.5", vec![5, 8]),
            ("pay 12.50", vec![9]),
        ] {
            assert_eq!(g.next_tokens(so_far, &ids(so_far), &t), Some(want), "after {so_far:?}");
        }
        assert!(!g.allows("pay 1", "x") && g.allows("pay 1", ".00</answer>"));
        assert_eq!(g.parts().0, ["pay {money}", "approve"]);
    }

    /// Over token ids a pattern's text is its canonical ids and its value any tokens wholly
    /// inside the value: no token may carry a value into the next piece.
    #[test]
    fn over_tokens_a_slot_takes_value_tokens_between_canonical_pieces() {
        let t: Vec<String> =
            ["", "pay ", "pay", " ", "12", "3", ".", ".5", "0", "</answer>", "x", "1.", "approve", " ||", "50</"]
                .map(String::from)
                .to_vec();
        let table: Vec<(&str, Vec<u32>)> =
            vec![("pay ", vec![1]), ("approve", vec![12]), (" || ", vec![13, 3]), ("</answer>", vec![9])];
        let encode = |s: &str| table.iter().find(|(k, _)| *k == s).map(|(_, v)| v.clone());
        let decode = |ids: &[u32]| Some(ids.iter().map(|&i| t[i as usize].as_str()).collect::<String>());
        let g =
            AnswerGrammar::new(&["pay {money}".into(), "approve".into()], 2, true).unwrap().with_tokens(encode, decode);
        for (ids, want) in [
            (vec![], vec![1, 12]),
            (vec![1], vec![4, 5, 8, 11]),
            (vec![1, 4], vec![4, 5, 6, 7, 8, 11]),
            (vec![1, 4, 7], vec![5, 8]),
            (vec![1, 4, 7, 8], vec![9, 13]),
            (vec![1, 4, 7, 8, 13, 3], vec![1, 12]),
        ] {
            let text: String = ids.iter().map(|&i| t[i as usize].as_str()).collect();
            assert_eq!(g.next_tokens(&text, &ids, &t), Some(want), "after {text:?}");
        }
        assert_eq!(g.next_tokens("pay 12.50</answer>", &[1, 4, 7, 8, 9], &t), None, "complete: free");
    }

    /// With its pieces tokenised, an answer is spelt in their canonical ids only: `U` then `p`
    /// or `pper`, never `Up` as `U` `p` `p` …; think mode starts at the token after `<answer>`.
    #[test]
    fn over_tokens_only_the_canonical_ids_may_follow_and_think_mode_waits_for_the_answer() {
        let t = texts();
        let table: Vec<(&str, Vec<u32>)> = vec![
            ("Up", vec![1, 2]),
            ("Down", vec![4]),
            ("Upper", vec![1, 3]),
            (" || ", vec![7, 11]),
            ("</answer>", vec![5]),
        ];
        let encode = |s: &str| table.iter().find(|(k, _)| *k == s).map(|(_, v)| v.clone());
        let decode = |ids: &[u32]| Some(ids.iter().map(|&i| t[i as usize].as_str()).collect::<String>());
        let g = grammar(2).with_tokens(encode, decode);
        assert_eq!(g.next_tokens("", &[], &t), Some(vec![1, 4]));
        assert_eq!(g.next_tokens("U", &[1], &t), Some(vec![2, 3]));
        assert_eq!(g.next_tokens("Up", &[1, 2], &t), Some(vec![5, 7]));
        assert_eq!(g.next_tokens("Up ||", &[1, 2, 7], &t), Some(vec![11]));
        assert_eq!(g.next_tokens("Up || ", &[1, 2, 7, 11], &t), Some(vec![1, 4]));
        assert_eq!(g.next_tokens("Upper</answer>", &[1, 3, 5], &t), None);
        // A piece that does not round-trip keeps the grammar over text.
        let lossy = grammar(1).with_tokens(|_| Some(vec![8]), decode);
        assert_eq!(lossy.next_tokens("Up", &[1, 2], &t), Some(vec![2, 5, 6]));
        let think = AnswerGrammar::new(&["Up".into()], 1, false).unwrap().with_tokens(encode, decode);
        assert_eq!(think.answer_part("I go up </think>"), None);
        assert_eq!(think.next_tokens("ok", &[13], &t), None, "outside the answer: free");
        assert_eq!(think.next_tokens("ok<answer>", &[13, 12], &t), Some(vec![1]));
        assert_eq!(think.next_tokens("ok<answer>U", &[13, 12, 1], &t), Some(vec![2]));
        // `<answer>` ends inside a token: its ids do not say where the answer starts, the text does.
        assert_eq!(think.next_tokens("<answer>U", &[14, 15], &t), Some(vec![2]));
    }
}
