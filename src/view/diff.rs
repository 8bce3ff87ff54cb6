//! A line diff between two versions of a script, for the dashboard's script timeline: the longest
//! common subsequence of lines, so each line is kept, removed or added. Quadratic in the lines,
//! which suits scripts (hundreds of lines); past [`MAX_CELLS`] it gives up on alignment and shows
//! the old text removed and the new one added.

/// Above this many (old lines × new lines) the table would cost too much memory.
pub const MAX_CELLS: usize = 4_000_000;

/// `' '` kept, `'-'` only in the old text, `'+'` only in the new one.
pub fn lines<'a>(old: &'a str, new: &'a str) -> Vec<(char, &'a str)> {
    let (a, b): (Vec<&str>, Vec<&str>) = (old.lines().collect(), new.lines().collect());
    if a.len() * b.len() > MAX_CELLS {
        return a.iter().map(|l| ('-', *l)).chain(b.iter().map(|l| ('+', *l))).collect();
    }
    // lcs[i][j]: the longest common subsequence of a[i..] and b[j..].
    let w = b.len() + 1;
    let mut lcs = vec![0u32; (a.len() + 1) * w];
    for i in (0..a.len()).rev() {
        for j in (0..b.len()).rev() {
            lcs[i * w + j] =
                if a[i] == b[j] { lcs[(i + 1) * w + j + 1] + 1 } else { lcs[(i + 1) * w + j].max(lcs[i * w + j + 1]) };
        }
    }
    let (mut i, mut j, mut out) = (0, 0, vec![]);
    while i < a.len() || j < b.len() {
        if i < a.len() && j < b.len() && a[i] == b[j] {
            out.push((' ', a[i]));
            (i, j) = (i + 1, j + 1);
        } else if j == b.len() || (i < a.len() && lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            out.push(('-', a[i]));
            i += 1;
        } else {
            out.push(('+', b[j]));
            j += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_edited_line_is_removed_then_added_and_the_rest_kept() {
        let old = "fn reward(t) {\n    t.env_reward\n}\n";
        let new = "fn reward(t) {\n    t.env_reward - 0.1\n}\n// new\n";
        assert_eq!(
            lines(old, new),
            vec![
                (' ', "fn reward(t) {"),
                ('-', "    t.env_reward"),
                ('+', "    t.env_reward - 0.1"),
                (' ', "}"),
                ('+', "// new"),
            ]
        );
        assert_eq!(lines("", "a"), vec![('+', "a")]);
        assert_eq!(lines("a\nb", ""), vec![('-', "a"), ('-', "b")]);
    }
}
