//! One episode's conversation: the system message, then alternating user and assistant turns,
//! and the context window the model sees (the full history, or the last k turns).
//!
//! The assistant turns hold what RAGEN's history keeps: the re-serialised
//! `<think>…</think><answer>a || b</answer>`, not the raw sample.
use crate::policy::Message;

#[derive(Clone, Debug, Default)]
pub struct History {
    pub system: String,
    /// (user message, assistant reply); the reply is `None` while the turn is being generated.
    pub turns: Vec<(String, Option<Message>)>,
}

impl History {
    pub fn new(system: impl Into<String>) -> Self {
        Self { system: system.into(), turns: Vec::new() }
    }

    pub fn push_user(&mut self, text: impl Into<String>) {
        self.turns.push((text.into(), None));
    }

    /// Record the reply to the open turn.
    pub fn push_assistant(&mut self, text: impl Into<String>) {
        self.push_reply(Message::assistant(text));
    }

    /// Record the reply to the open turn, with what it carries (an unscored range).
    pub fn push_reply(&mut self, reply: Message) {
        if let Some(last) = self.turns.last_mut() {
            last.1 = Some(reply);
        }
    }

    /// The chat the model sees: the system message, then the last `window` turns (0 = all).
    /// A windowed view drops whole (user, assistant) pairs from the front, as RAGEN's
    /// `max_context_window` does (rewards shown in dropped turns are dropped with them).
    pub fn messages(&self, window: usize) -> Vec<Message> {
        let start = if window == 0 { 0 } else { self.turns.len().saturating_sub(window) };
        let mut out = Vec::with_capacity(1 + 2 * (self.turns.len() - start));
        if !self.system.is_empty() {
            out.push(Message::system(self.system.clone()));
        }
        for (user, reply) in &self.turns[start..] {
            out.push(Message::user(user.clone()));
            if let Some(r) = reply {
                out.push(r.clone());
            }
        }
        out
    }

    /// How many turns `messages(window)` shows.
    pub fn visible_turns(&self, window: usize) -> usize {
        if window == 0 {
            self.turns.len()
        } else {
            self.turns.len().min(window)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn three_turns() -> History {
        let mut h = History::new("sys");
        for i in 1..=3 {
            h.push_user(format!("u{i}"));
            h.push_assistant(format!("a{i}"));
        }
        h
    }

    #[test]
    fn full_history_alternates_roles() {
        let m = three_turns().messages(0);
        let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user", "assistant", "user", "assistant"]);
        assert_eq!(m[5].content, "u3");
    }

    #[test]
    fn window_keeps_the_last_k_turns_and_the_system_message() {
        let mut h = three_turns();
        h.push_user("u4");
        let m = h.messages(2);
        let texts: Vec<&str> = m.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(texts, ["sys", "u3", "a3", "u4"]);
        assert_eq!(h.visible_turns(2), 2);
        assert_eq!(h.visible_turns(0), 4);
    }
}
