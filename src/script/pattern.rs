//! Actions with arguments. An env's action may hold value slots, `extract total={money}`: the
//! command is spelt as written and each slot takes a value of its shape. The answer grammar
//! (`rollout.constrain_actions`) follows a pattern byte by byte, the turn parser accepts any text
//! it matches, and a bad slot is an error where the env declares it.
//!
//! A pattern is a run of [`Item`]s, each a symbol repeated between `min` and `max` times, so
//! both the grammar and the matcher walk one small automaton (states: item and count).

/// The value shapes a slot may name, `{name}`, with what each accepts.
pub const SHAPES: &[(&str, &str)] = &[
    ("digits", "1–12 digits"),
    ("money", "an amount with two decimals: 1234.50"),
    ("date", "YYYY-MM-DD"),
    ("id", "a letter or digit, then letters, digits and dashes (up to 32): INV-10442"),
    ("word", "1–24 letters"),
    ("text", "1–48 characters of plain text, no `|`, `<`, `>`, `{` or `}`"),
];

/// A set of bytes a slot's position accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    Digit,
    Alpha,
    Alnum,
    /// Letters, digits and `-`.
    IdChar,
    /// Printable ASCII and space, less the bytes that would end or nest an answer.
    Text,
}

impl Class {
    pub fn contains(self, b: u8) -> bool {
        match self {
            Class::Digit => b.is_ascii_digit(),
            Class::Alpha => b.is_ascii_alphabetic(),
            Class::Alnum => b.is_ascii_alphanumeric(),
            Class::IdChar => b.is_ascii_alphanumeric() || b == b'-',
            Class::Text => (b' '..=b'~').contains(&b) && !b"|<>{}".contains(&b),
        }
    }
}

/// One position of a pattern: the byte itself (`Is`) or any member of a class.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sym {
    Is(u8),
    Class(Class),
}

/// A symbol repeated `min..=max` times (a literal byte: once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    pub sym: Sym,
    pub min: u8,
    pub max: u8,
}

impl Item {
    pub fn once(b: u8) -> Self {
        Item { sym: Sym::Is(b), min: 1, max: 1 }
    }
}

impl Sym {
    pub fn accepts(self, b: u8) -> bool {
        match self {
            Sym::Is(x) => b == x,
            Sym::Class(c) => c.contains(b),
        }
    }
}

fn shape(name: &str) -> Option<Vec<Item>> {
    let rep = |c, min, max| Item { sym: Sym::Class(c), min, max };
    let dash = Item::once(b'-');
    Some(match name {
        "digits" => vec![rep(Class::Digit, 1, 12)],
        "money" => vec![rep(Class::Digit, 1, 9), Item::once(b'.'), rep(Class::Digit, 2, 2)],
        "date" => vec![rep(Class::Digit, 4, 4), dash, rep(Class::Digit, 2, 2), dash, rep(Class::Digit, 2, 2)],
        "id" => vec![rep(Class::Alnum, 1, 1), rep(Class::IdChar, 0, 31)],
        "word" => vec![rep(Class::Alpha, 1, 24)],
        "text" => vec![rep(Class::Text, 1, 48)],
        _ => return None,
    })
}

/// Whether `action` holds a slot (a `{`); an action without one is a plain name.
pub fn has_slot(action: &str) -> bool {
    action.contains('{')
}

/// A piece of an action: text spelt as written, or a slot's value shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Lit(String),
    Slot(Vec<Item>),
}

/// An action's parts, or what is wrong with it: an unknown shape, a brace left open, a `}` with
/// no `{`, or text the answer grammar could never hold (empty, `||`, `<`, `>`).
pub fn parts(action: &str) -> Result<Vec<Part>, String> {
    if action.trim().is_empty() {
        return Err("an empty action can never be answered".into());
    }
    if action.contains("||") || action.contains('<') || action.contains('>') {
        return Err(format!("action `{action}` holds `||`, `<` or `>`, which end an answer: it can never be answered"));
    }
    let mut out = Vec::new();
    let mut rest = action;
    while let Some(open) = rest.find(['{', '}']) {
        if open > 0 {
            out.push(Part::Lit(rest[..open].to_string()));
        }
        if rest.as_bytes()[open] == b'}' {
            return Err(format!("action `{action}`: a `}}` with no `{{` before it"));
        }
        let Some(len) = rest[open..].find('}') else {
            return Err(format!("action `{action}`: the slot `{}` is not closed with `}}`", &rest[open..]));
        };
        let name = &rest[open + 1..open + len];
        let Some(items) = shape(name) else {
            let known: Vec<String> = SHAPES.iter().map(|(n, _)| format!("{{{n}}}")).collect();
            return Err(format!("action `{action}`: unknown value shape `{{{name}}}`; known: {}", known.join(", ")));
        };
        out.push(Part::Slot(items));
        rest = &rest[open + len + 1..];
    }
    if !rest.is_empty() {
        out.push(Part::Lit(rest.to_string()));
    }
    Ok(out)
}

/// An action's items over bytes (its parts run together), or what is wrong with it.
pub fn parse(action: &str) -> Result<Vec<Item>, String> {
    Ok(parts(action)?
        .into_iter()
        .flat_map(|p| match p {
            Part::Lit(t) => t.bytes().map(Item::once).collect(),
            Part::Slot(items) => items,
        })
        .collect())
}

/// The items of `action`, a plain name where it does not parse (`check` reports it).
pub fn items(action: &str) -> Vec<Item> {
    parse(action).unwrap_or_else(|_| action.bytes().map(Item::once).collect())
}

/// Where a walk through one pattern stands: at item `item`, `count` symbols into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Pos {
    pub item: usize,
    pub count: u8,
}

/// The moves from `at` in `items`: each symbol that may come next, with where it leads (`None`:
/// the pattern is complete after it), plus `done` when the pattern may end here.
pub fn moves(items: &[Item], at: Pos, out: &mut Vec<(Sym, Option<Pos>)>) -> bool {
    let Some(it) = items.get(at.item) else { return true };
    if at.count < it.max {
        let next = Pos { item: at.item, count: at.count + 1 };
        out.push((it.sym, normal(items, next)));
    }
    // Enough of this item: the next one may start (the same text, no symbol read).
    at.count >= it.min && moves(items, Pos { item: at.item + 1, count: 0 }, out)
}

/// `at`, or `None` where it is past the last item.
fn normal(items: &[Item], at: Pos) -> Option<Pos> {
    match items.get(at.item) {
        Some(it) if at.count == it.max => normal(items, Pos { item: at.item + 1, count: 0 }),
        Some(_) => Some(at),
        None => None,
    }
}

/// Where `bytes` lead from `at` in `items`: each place they may end (`None`: past the last
/// item); empty where they leave the pattern.
pub fn walk(items: &[Item], at: Pos, bytes: &[u8]) -> Vec<Option<Pos>> {
    let mut states = vec![Some(at)];
    let mut m = Vec::new();
    for &b in bytes {
        let mut next = Vec::new();
        for s in states.iter().flatten() {
            m.clear();
            moves(items, *s, &mut m);
            for &(sym, to) in &m {
                if sym.accepts(b) && !next.contains(&to) {
                    next.push(to);
                }
            }
        }
        states = next;
    }
    states
}

/// Whether `text` is an answer to `action` (its literal bytes matched case-insensitively, as
/// plain names are).
pub fn matches(action: &str, text: &str) -> bool {
    let items = items(&action.to_ascii_lowercase());
    let ends = walk(&items, Pos { item: 0, count: 0 }, text.to_ascii_lowercase().as_bytes());
    ends.iter().any(|s| match s {
        None => true,
        Some(p) => moves(&items, *p, &mut Vec::new()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_of_each_shape_match_and_nothing_else() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            (
                "extract total={money}",
                &["extract total=120.00", "EXTRACT Total=7.05"],
                &["extract total=120", "extract total=1.5", "extract total=", "extract total=12.000"],
            ),
            ("due {date}", &["due 2025-01-28"], &["due 2025-1-28", "due 2025-01-28x"]),
            ("po {id}", &["po PO-4412", "po 7"], &["po -12", "po ", "po PO 44"]),
            ("count {digits}", &["count 0", "count 123456789012"], &["count 1234567890123", "count x"]),
            ("name {word}", &["name Acme"], &["name Acme2"]),
            ("vendor={text}", &["vendor=Acme Supplies", "vendor=x"], &["vendor=", "vendor=a|b", "vendor=<x>"]),
            ("approve", &["approve", "Approve"], &["approve it"]),
        ];
        for (action, good, bad) in cases {
            for t in *good {
                assert!(matches(action, t), "{action} should match {t}");
            }
            for t in *bad {
                assert!(!matches(action, t), "{action} should not match {t}");
            }
        }
    }

    #[test]
    fn bad_patterns_say_what_is_wrong() {
        let err = |a: &str| parse(a).unwrap_err();
        assert!(err("pay {amount}").contains("unknown value shape `{amount}`; known: {digits}, {money}"));
        assert!(err("pay {money").contains("not closed"));
        assert!(err("pay money}").contains("no `{`"));
        assert!(err("a || b").contains("can never be answered"));
        assert!(err("<b>").contains("can never be answered"));
        assert!(err(" ").contains("empty"));
        assert_eq!(parse("pay {digits}!").unwrap().len(), "pay ".len() + 1 + 1);
        assert!(!has_slot("approve") && has_slot("pay {money}"));
    }
}
