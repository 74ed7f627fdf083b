//! Request fields beyond the ones the route types read: llama-server's and OpenAI's fields that
//! this server does not build are accepted at the value that leaves the output unchanged (clients
//! such as llama.cpp's web UI send every field with its default) and refused by name otherwise,
//! never ignored. Also `logit_bias` in both APIs' shapes.

use super::errors::ApiError;
use crate::llama::Model;
use serde_json::Value;

/// What the target law here is made of, for refusals.
const CHAIN: &str = "logit_bias, penalties (repeat, presence, frequency), top_k, top_p, min_p and temperature, \
                     in llama.cpp's default order";

/// The samplers of the target law here, in their order (llama.cpp's names).
pub const SAMPLERS: [&str; 5] = ["penalties", "top_k", "top_p", "min_p", "temperature"];

/// A field, whether a value of it changes nothing, and what the value would need.
struct Unbuilt {
    name: &'static str,
    neutral: fn(&Value) -> bool,
    needs: &'static str,
}

fn num(v: &Value) -> Option<f64> {
    v.as_f64()
}
fn null_or(v: &Value, f: impl Fn(&Value) -> bool) -> bool {
    v.is_null() || f(v)
}
fn empty(v: &Value) -> bool {
    null_or(v, |v| v.as_str() == Some("") || v.as_array().is_some_and(Vec::is_empty) || v.as_object().is_some_and(|o| o.is_empty()))
}

const UNBUILT: &[Unbuilt] = &[
    Unbuilt { name: "typical_p", neutral: |v| null_or(v, |v| num(v).is_some_and(|x| x >= 1.0)), needs: "a sampler" },
    Unbuilt { name: "mirostat", neutral: |v| null_or(v, |v| num(v) == Some(0.0)), needs: "a sampler" },
    Unbuilt { name: "dry_multiplier", neutral: |v| null_or(v, |v| num(v).is_some_and(|x| x <= 0.0)), needs: "a sampler" },
    Unbuilt { name: "xtc_probability", neutral: |v| null_or(v, |v| num(v).is_some_and(|x| x <= 0.0)), needs: "a sampler" },
    Unbuilt { name: "top_n_sigma", neutral: |v| null_or(v, |v| num(v).is_some_and(|x| x <= 0.0)), needs: "a sampler" },
    Unbuilt { name: "dynatemp_range", neutral: |v| null_or(v, |v| num(v).is_some_and(|x| x <= 0.0)), needs: "a sampler" },
    Unbuilt { name: "min_keep", neutral: |v| null_or(v, |v| num(v) == Some(0.0)), needs: "a sampler setting" },
    Unbuilt {
        name: "post_sampling_probs",
        neutral: |v| null_or(v, |v| v == &Value::Bool(false)),
        needs: "probabilities after the samplers (the raw target's are reported)",
    },
    Unbuilt { name: "lora", neutral: empty, needs: "LoRA adapters" },
];

/// Refuses a field of `body` that asks for something this server does not do.
pub fn refuse_unbuilt(body: &Value) -> Result<(), ApiError> {
    let Some(obj) = body.as_object() else { return Ok(()) };
    for u in UNBUILT {
        if let Some(v) = obj.get(u.name) {
            if !(u.neutral)(v) {
                return Err(ApiError::invalid_param(
                    u.name,
                    format!("`{}` = {v} needs {}, which this server does not offer; leave it out or at its neutral value", u.name, u.needs),
                ));
            }
        }
    }
    Ok(())
}

/// The sampler names of llama.cpp's `samplers` field (a list of names, or a string of its
/// one-letter codes) that change the law here; every other sampler is off in this server.
fn applied_samplers(v: &Value) -> Result<Vec<&'static str>, ApiError> {
    let bad = |what: String| ApiError::invalid_param("samplers", what);
    let names: Vec<String> = match v {
        Value::String(codes) => codes.chars().map(|c| c.to_string()).collect(),
        Value::Array(items) => items
            .iter()
            .map(|x| x.as_str().map(str::to_string).ok_or_else(|| bad(format!("`samplers`: {x} is not a sampler name"))))
            .collect::<Result<_, _>>()?,
        _ => return Err(bad("`samplers` must be a list of sampler names or a string of their letters".into())),
    };
    let mut applied = Vec::new();
    for n in &names {
        let name = match n.as_str() {
            "e" | "penalties" => "penalties",
            "k" | "top_k" => "top_k",
            "p" | "top_p" | "nucleus" => "top_p",
            "m" | "min_p" => "min_p",
            "t" | "temperature" | "temp" => "temperature",
            // off unless their own fields turn them on, which refuse_unbuilt refuses
            "d" | "dry" | "y" | "typ_p" | "typical_p" | "typ" | "x" | "xtc" | "s" | "top_n_sigma" | "i" | "infill" => continue,
            other => return Err(bad(format!("`samplers`: unknown sampler {other:?}"))),
        };
        applied.push(name);
    }
    Ok(applied)
}

/// Checks a `samplers` field against the law the request gets: the samplers it lists that do
/// something must be this server's, in its order (a sampler left out is off in llama.cpp, so it
/// must be off in the request too).
pub fn check_samplers(v: Option<&Value>, law: &crate::sampling::SamplingParams) -> Result<(), ApiError> {
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(()) };
    let applied = applied_samplers(v)?;
    let order = SAMPLERS;
    let in_order = applied.windows(2).all(|w| order.iter().position(|&o| o == w[0]) < order.iter().position(|&o| o == w[1]));
    let on = [
        ("penalties", law.uses_history()),
        ("top_k", law.top_k > 0),
        ("top_p", law.top_p < 1.0),
        ("min_p", law.min_p > 0.0),
        ("temperature", true),
    ];
    let missing: Vec<&str> = on.iter().filter(|(n, on)| *on && !applied.contains(n)).map(|(n, _)| *n).collect();
    if !in_order || !missing.is_empty() {
        return Err(ApiError::invalid_param(
            "samplers",
            format!("`samplers` = {v}: this server's law is {CHAIN}; list them in that order (left out: {missing:?})"),
        ));
    }
    Ok(())
}

/// The GBNF grammar a request constrains its output to: llama-server's `grammar` (GBNF),
/// `json_schema`, or OpenAI's `response_format` (`json_object`, optionally with a `schema`, or
/// `json_schema` with `json_schema.schema`); JSON schemas through llama.cpp's converter.
pub fn grammar(
    grammar: Option<&str>,
    json_schema: Option<&Value>,
    response_format: Option<&Value>,
    model: &Model,
) -> Result<Option<String>, ApiError> {
    let from_format = match response_format.filter(|v| !v.is_null()) {
        None => None,
        Some(rf) => match rf.get("type").and_then(Value::as_str) {
            Some("text") => None,
            Some("json_object") => Some(rf.get("schema").cloned().unwrap_or_else(|| Value::Object(Default::default()))),
            Some("json_schema") => Some(
                rf.pointer("/json_schema/schema").or_else(|| rf.get("schema")).cloned().unwrap_or_else(|| Value::Object(Default::default())),
            ),
            _ => {
                return Err(ApiError::invalid_param(
                    "response_format",
                    format!("`response_format` = {rf}: the type must be text, json_object or json_schema"),
                ))
            }
        },
    };
    let schema = match (json_schema.filter(|v| !v.is_null()), from_format) {
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid_param("json_schema", "give `json_schema` or `response_format`, not both"))
        }
        (Some(s), None) => Some(("json_schema", s.clone())),
        (None, Some(s)) => Some(("response_format", s)),
        (None, None) => None,
    };
    let gbnf = match (grammar.filter(|g| !g.is_empty()), schema) {
        (Some(_), Some((name, _))) => {
            return Err(ApiError::invalid_param("grammar", format!("give `grammar` or `{name}`, not both")))
        }
        (Some(g), None) => ("grammar", g.to_string()),
        (None, Some((name, schema))) => {
            let g = crate::llama::Grammar::from_json_schema(&schema.to_string())
                .map_err(|e| ApiError::invalid_param(name, format!("`{name}`: {e}")))?;
            (name, g)
        }
        (None, None) => return Ok(None),
    };
    // Parsed here so that a bad grammar is the client's 400, not a failed generation.
    crate::llama::Grammar::new(model, &gbnf.1).map_err(|e| ApiError::invalid_param(gbnf.0, format!("`{}`: {e}", gbnf.0)))?;
    Ok(Some(gbnf.1))
}

/// `logit_bias` as OpenAI sends it (`{"15043": 1.5}`) or llama-server (`[[15043, 1.5]]`, a text
/// instead of an id biases each of its tokens, `false` bans).
pub fn logit_bias(v: Option<&Value>, model: &Model) -> Result<Vec<(i32, f32)>, ApiError> {
    let bad = |what: String| ApiError::invalid_param("logit_bias", format!("`logit_bias`: {what}"));
    let pairs: Vec<(Value, &Value)> = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(o)) => o.iter().map(|(k, b)| (Value::String(k.clone()), b)).collect(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|p| match p.as_array().map(Vec::as_slice) {
                Some([key, bias]) => Ok((key.clone(), bias)),
                _ => Err(bad(format!("{p} is not a [token, bias] pair"))),
            })
            .collect::<Result<_, _>>()?,
        Some(other) => return Err(bad(format!("{other} is neither an object nor a list of pairs"))),
    };
    let n_vocab = model.n_vocab() as i64;
    let mut out = Vec::new();
    for (key, bias) in pairs {
        let bias = match bias {
            Value::Bool(false) => f32::NEG_INFINITY,
            b => match b.as_f64() {
                Some(x) if x.is_finite() => x as f32,
                _ => return Err(bad(format!("the bias of {key} must be a number or false, got {b}"))),
            },
        };
        let ids: Vec<i64> = match &key {
            Value::Number(n) => vec![n.as_i64().ok_or_else(|| bad(format!("{n} is not a token id")))?],
            Value::String(s) => match s.parse::<i64>() {
                Ok(id) => vec![id],
                Err(_) => model
                    .tokenize(s, false, false)
                    .map_err(|e| bad(e.to_string()))?
                    .into_iter()
                    .map(i64::from)
                    .collect(),
            },
            other => return Err(bad(format!("{other} is neither a token id nor a text"))),
        };
        for id in ids {
            if !(0..n_vocab).contains(&id) {
                return Err(bad(format!("token {id} is outside the vocabulary (0..{n_vocab})")));
            }
            out.push((id as i32, bias));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn neutral_values_pass_and_others_name_their_field() {
        let webui = json!({ "typical_p": 1, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0, "top_n_sigma": -1,
            "dynatemp_range": 0, "post_sampling_probs": false, "tools": [], "tool_choice": "auto",
            "id_slot": -1, "cache_prompt": true, "lora": [] });
        refuse_unbuilt(&webui).unwrap();
        for (field, value) in [("typical_p", json!(0.9)), ("post_sampling_probs", json!(true)), ("lora", json!([{ "id": 0 }]))]
        {
            let ApiError::InvalidRequest { param, message } = refuse_unbuilt(&json!({ field: value })).unwrap_err() else { panic!() };
            assert_eq!(param.as_deref(), Some(field));
            assert!(message.contains(field), "{message}");
        }
    }

    #[test]
    fn samplers_must_be_this_servers_chain_in_its_order() {
        let law = crate::sampling::SamplingParams::default(); // top_k, top_p, min_p on; penalties off
        check_samplers(Some(&json!("edkypmxt")), &law).unwrap(); // llama.cpp's web UI default
        check_samplers(Some(&json!(["penalties", "top_k", "top_p", "min_p", "temperature"])), &law).unwrap();
        check_samplers(None, &law).unwrap();
        let err = |v: Value| match check_samplers(Some(&v), &law).unwrap_err() {
            ApiError::InvalidRequest { param, .. } => param,
            _ => panic!(),
        };
        assert_eq!(err(json!("tkpm")), Some("samplers".into())); // temperature first
        assert_eq!(err(json!("kpt")), Some("samplers".into())); // min_p on but left out
        assert_eq!(err(json!(["top_k", "bogus"])), Some("samplers".into()));
        let no_min_p = crate::sampling::SamplingParams { min_p: 0.0, ..law };
        check_samplers(Some(&json!("kpt")), &no_min_p).unwrap();
    }
}
