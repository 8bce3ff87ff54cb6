//! Environment parameters: the script's defaults (`fn params()`) overridden by `--param key=value`.
//!
//! Values are parsed as JSON when they parse (`3`, `0.5`, `true`, `["a","b"]`), as a list when
//! they hold commas (`Teacher,Engineer`), else as a string; then shaped to the default's type
//! (an int default with `0.5` is an error, a float default accepts `2`, a list default accepts a
//! single item). Unknown keys are errors naming the known ones.
use serde_json::{Map, Value};

/// Splits `key=value`.
pub fn parse_assignment(text: &str) -> Result<(String, String), String> {
    match text.split_once('=') {
        Some((k, v)) if !k.trim().is_empty() => Ok((k.trim().to_string(), v.trim().to_string())),
        _ => Err(format!("--param {text:?}: expected key=value, e.g. --param size=8")),
    }
}

fn parse_value(raw: &str) -> Value {
    if let Ok(v) = serde_json::from_str::<Value>(raw) {
        return v;
    }
    if raw.contains(',') {
        return Value::Array(raw.split(',').map(|p| parse_value(p.trim())).collect());
    }
    Value::String(raw.to_string())
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "nothing",
        Value::Bool(_) => "a bool",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "a map",
    }
}

/// Converts `raw` to the type of `default` (see the module docs).
fn shape(key: &str, raw: &str, default: &Value) -> Result<Value, String> {
    let v = parse_value(raw);
    let bad = || format!("--param {key}={raw}: expected {} like the default {default}", kind(default));
    Ok(match (default, v) {
        (Value::String(_), Value::String(s)) => Value::String(s),
        // A string default takes the raw text, even when it looks like a number.
        (Value::String(_), _) => Value::String(raw.to_string()),
        (Value::Number(d), Value::Number(n)) if d.is_f64() => Value::from(n.as_f64().ok_or_else(bad)?),
        (Value::Number(_), Value::Number(n)) if n.is_i64() => Value::Number(n),
        (Value::Bool(_), Value::Bool(b)) => Value::Bool(b),
        (Value::Array(_), Value::Array(a)) => Value::Array(a),
        (Value::Array(_), one) => Value::Array(vec![one]),
        (Value::Null, v) => v,
        (Value::Object(_), v @ Value::Object(_)) => v,
        _ => return Err(bad()),
    })
}

/// Applies overrides to the defaults. `source` names the script in messages.
pub fn apply(
    source: &str,
    defaults: &Map<String, Value>,
    overrides: &[(String, String)],
) -> Result<Map<String, Value>, String> {
    let mut out = defaults.clone();
    for (key, raw) in overrides {
        let Some(default) = defaults.get(key) else {
            let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
            let known =
                if known.is_empty() { "none (the script has no fn params())".to_string() } else { known.join(", ") };
            return Err(format!("--param {key}: {source} has no parameter `{key}`; known parameters: {known}"));
        };
        out.insert(key.clone(), shape(key, raw, default)?);
    }
    Ok(out)
}

/// Merges a map of already-typed values (e.g. an experiment's `params`) over the defaults, with the
/// same unknown-key check.
pub fn merge(
    source: &str,
    defaults: &Map<String, Value>,
    given: &Map<String, Value>,
) -> Result<Map<String, Value>, String> {
    let mut out = defaults.clone();
    for (key, v) in given {
        if !defaults.contains_key(key) {
            let known: Vec<&str> = defaults.keys().map(String::as_str).collect();
            return Err(format!(
                "parameter `{key}`: {source} has no such parameter; known parameters: {}",
                known.join(", ")
            ));
        }
        out.insert(key.clone(), v.clone());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn defaults() -> Map<String, Value> {
        json!({"size": 6, "slip": 0.3, "names": ["Dragon", "Phoenix"], "slippery": true, "label": "x"})
            .as_object()
            .unwrap()
            .clone()
    }

    #[test]
    fn overrides_take_the_type_of_the_default() {
        let ov: Vec<(String, String)> = ["size=8", "slip=1", "names=Teacher,Engineer", "slippery=false", "label=12"]
            .iter()
            .map(|a| parse_assignment(a).unwrap())
            .collect();
        let p = apply("envs/x.rhai", &defaults(), &ov).unwrap();
        assert_eq!(
            Value::Object(p),
            json!({"size": 8, "slip": 1.0, "names": ["Teacher", "Engineer"], "slippery": false, "label": "12"})
        );
    }

    #[test]
    fn unknown_keys_and_wrong_types_are_named() {
        let e = apply("envs/x.rhai", &defaults(), &[("sise".into(), "3".into())]).unwrap_err();
        assert!(e.contains("no parameter `sise`") && e.contains("size, slip"), "{e}");
        let e = apply("envs/x.rhai", &defaults(), &[("size".into(), "big".into())]).unwrap_err();
        assert!(e.contains("expected an integer"), "{e}");
        assert!(parse_assignment("size").is_err());
    }
}
