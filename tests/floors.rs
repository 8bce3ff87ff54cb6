//! The modules stand in floors and import only downwards (DESIGN.md "Modules (src/), in floors").
//! This test reads every `crate::` path in src/ (in `use` lines and inline, grouped ones too)
//! and fails on an edge that points up or sideways-up, naming the file and line.
use std::path::{Path, PathBuf};

/// Bottom to top; a module may import only those before it. Modules on one floor of the
/// picture are ordered too (agent sits on policy), so no two modules can import each other.
const ORDER: &[(&str, u32)] = &[
    ("rng", 0),
    ("phase", 0),
    ("script", 0),
    ("policy", 1),
    ("remote", 1),
    ("agent", 1),
    ("metrics", 2),
    ("starpo", 3),
    ("view", 4),
    ("serve", 4),
    ("cli", 5),
];

fn rank(module: &str) -> Option<usize> {
    ORDER.iter().position(|(m, _)| *m == module)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The text with `//` comments blanked (doc links may name any module) and string literals
/// kept: a `crate::` inside a string is rare enough to be worth a look if it ever trips this.
fn strip_comments(line: &str) -> &str {
    match line.find("//") {
        Some(i) => &line[..i],
        None => line,
    }
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first-segment modules named after each `crate::` in `text`.
pub fn imported_modules(text: &str) -> Vec<String> {
    segments_after(text, "crate::")
}

/// The first path segments named after each `prefix` (`crate::`, `super::`, `crate::agent::`)
/// in `text`, grouped ones too.
fn segments_after(text: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(prefix) {
        let before = &rest[..i];
        rest = &rest[i + prefix.len()..];
        // `$crate::` (a macro) is the same crate; anything else ending in an ident char is
        // another path (`my_crate::`, `self::super::`), not ours.
        if before.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let trimmed = rest.trim_start();
        if let Some(group) = trimmed.strip_prefix('{') {
            let mut depth = 1;
            let mut piece_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => piece_start = true,
                    c if c.is_whitespace() => {}
                    _ if piece_start && depth == 1 => {
                        out.push(ident_at(&group[j..]).to_string());
                        piece_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident_at(trimmed).to_string());
        }
    }
    out
}

#[test]
fn imports_point_only_down_the_floors() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut upward = Vec::new();
    let mut unknown = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
        let module = first.trim_end_matches(".rs").to_string();
        // The crate root, the binary and the crate-wide macros stand outside the floors.
        if ["lib", "main", "macros"].contains(&module.as_str()) {
            continue;
        }
        let Some(from) = rank(&module) else {
            unknown.push(format!("{}: module `{module}` has no floor in ORDER", rel.display()));
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        // `use` groups may span lines: read the file as one text, comments removed line by line.
        let code: String = text.lines().map(|l| format!("{}\n", strip_comments(l))).collect();
        for (n, line) in code.lines().enumerate() {
            // Attribute the imports to the line holding `crate::`.
            for target in imported_modules(line) {
                if target == module || target == "super" || target == "self" {
                    continue;
                }
                match rank(&target) {
                    Some(to) if to < from => {}
                    Some(_) => upward.push(format!("{}:{}: {module} imports {target}", rel.display(), n + 1)),
                    None if target.is_empty() => {}
                    None => unknown.push(format!("{}:{}: `crate::{target}` has no floor", rel.display(), n + 1)),
                }
            }
        }
        // Grouped imports spanning lines: `use crate::{\n a::b,\n c::d\n};`.
        for group in code.split("crate::{").skip(1) {
            let body: String = group.chars().take_while(|c| *c != ';').collect();
            if !body.contains('\n') {
                continue;
            }
            for target in imported_modules(&format!("crate::{{{body}")) {
                if target != module && rank(&target).is_some_and(|to| to >= from) {
                    upward.push(format!("{}: {module} imports {target} (in a multi-line group)", rel.display()));
                }
            }
        }
    }
    assert!(unknown.is_empty(), "modules without a floor:\n{}", unknown.join("\n"));
    assert!(upward.is_empty(), "imports that point up the floors (DESIGN.md):\n{}", upward.join("\n"));
}

#[test]
fn the_reader_sees_plain_grouped_inline_and_macro_paths() {
    let text = "use crate::script::{A, B};\nuse crate::{agent::x, policy::{y, z}};\nlet a = crate::starpo::f();\n$crate::view::g\nother_crate::cli::h";
    assert_eq!(imported_modules(text), ["script", "agent", "policy", "starpo", "view"]);
}

/// Each file's imports of its sibling files (`super::x`, `crate::<folder>::x`), test modules left
/// out: `folder/file` → the siblings it names.
fn sibling_imports(src: &Path) -> std::collections::BTreeMap<String, Vec<String>> {
    let mut graph = std::collections::BTreeMap::new();
    for dir in std::fs::read_dir(src).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()) {
        let folder = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        let stem = |p: &Path| p.file_stem().unwrap().to_string_lossy().to_string();
        let siblings: Vec<String> = files.iter().map(|f| stem(f)).filter(|s| s != "mod").collect();
        for file in &files {
            let name = stem(file);
            let text = std::fs::read_to_string(file).unwrap();
            let text = &text[..text.find("#[cfg(test)]").unwrap_or(text.len())];
            let code: String = text.lines().map(|l| format!("{}\n", strip_comments(l))).collect();
            let mut named = segments_after(&code, "super::");
            named.extend(segments_after(&code, &format!("crate::{folder}::")));
            named.retain(|n| *n != name && siblings.contains(n));
            named.sort();
            named.dedup();
            graph.insert(format!("{folder}/{name}"), named.into_iter().map(|n| format!("{folder}/{n}")).collect());
        }
    }
    graph
}

/// The strongly connected sets of more than one node (Tarjan), each sorted, in sorted order.
fn circles(graph: &std::collections::BTreeMap<String, Vec<String>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        graph: &'a std::collections::BTreeMap<String, Vec<String>>,
        index: std::collections::HashMap<&'a str, (usize, usize)>,
        stack: Vec<&'a str>,
        out: Vec<Vec<String>>,
    }
    fn visit<'a>(w: &mut Walk<'a>, v: &'a str) {
        let n = w.index.len();
        w.index.insert(v, (n, n));
        w.stack.push(v);
        for u in w.graph.get(v).into_iter().flatten() {
            let low = match w.index.get(u.as_str()) {
                None => {
                    visit(w, u);
                    w.index[u.as_str()].1
                }
                Some(&(i, _)) if w.stack.contains(&u.as_str()) => i,
                Some(_) => continue,
            };
            let entry = w.index.get_mut(v).unwrap();
            entry.1 = entry.1.min(low);
        }
        let (i, low) = w.index[v];
        if i == low {
            let at = w.stack.iter().position(|x| *x == v).unwrap();
            let mut set: Vec<String> = w.stack.drain(at..).map(String::from).collect();
            if set.len() > 1 {
                set.sort();
                w.out.push(set);
            }
        }
    }
    let mut w = Walk { graph, index: Default::default(), stack: vec![], out: vec![] };
    for v in graph.keys() {
        if !w.index.contains_key(v.as_str()) {
            visit(&mut w, v);
        }
    }
    w.out.sort();
    w.out
}

#[test]
fn no_file_imports_a_file_of_its_folder_that_imports_it_back() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let graph = sibling_imports(&src);
    assert!(graph.get("agent/engine").is_some_and(|d| d.contains(&"agent/settings".to_string())), "{graph:?}");
    let found = circles(&graph);
    assert!(found.is_empty(), "files of one folder that import each other (through the others listed): {found:?}");
}

#[test]
fn circles_are_found_through_any_number_of_files() {
    let graph = |edges: &[(&str, &str)]| {
        let mut g = std::collections::BTreeMap::<String, Vec<String>>::new();
        for (a, b) in edges {
            g.entry(a.to_string()).or_default().push(b.to_string());
            g.entry(b.to_string()).or_default();
        }
        g
    };
    assert!(circles(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    assert_eq!(circles(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])), vec![vec!["a", "b", "c"]]);
    assert_eq!(circles(&graph(&[("x", "y"), ("y", "x"), ("p", "q"), ("q", "p")])).len(), 2);
    let code = "use super::{env::{A, B}, error::E};\nuse crate::script::turn::T;\nlet x = self_super::nope;";
    assert_eq!(segments_after(code, "super::"), ["env", "error"]);
    assert_eq!(segments_after(code, "crate::script::"), ["turn"]);
}
