//! The `prompt` field of the text routes as llama-server reads it: a text; token ids, with texts
//! among them (one prompt); or a list of prompts (texts, id lists, `{"prompt_string": ..}`
//! objects), each answered on its own.

use serde::Deserialize;
use serde_json::Value;

/// One piece of a prompt.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    Id(i64),
    Text(String),
}

/// The prompts of one request, each a sequence of pieces.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "Value")]
pub struct Prompts(pub Vec<Vec<Part>>);

/// Most prompts one request may hold (each takes a slot or a place in the queue).
pub const MAX_PROMPTS: usize = 16;

impl TryFrom<Value> for Prompts {
    type Error = String;

    fn try_from(v: Value) -> Result<Self, String> {
        let prompts = match &v {
            // llama-server: a list of numbers, or of numbers and texts, is one prompt; any
            // other list is a list of prompts
            Value::Array(items) if items.iter().any(Value::is_i64) => vec![one(&v)?],
            Value::Array(items) if items.is_empty() => return Err("the prompt list is empty".into()),
            Value::Array(items) => items.iter().map(one).collect::<Result<_, _>>()?,
            _ => vec![one(&v)?],
        };
        if prompts.len() > MAX_PROMPTS {
            return Err(format!("{} prompts in one request; at most {MAX_PROMPTS}", prompts.len()));
        }
        Ok(Self(prompts))
    }
}

/// One prompt: a text, a `{"prompt_string": ..}` object, or ids and texts.
fn one(v: &Value) -> Result<Vec<Part>, String> {
    match v {
        Value::String(s) => Ok(vec![Part::Text(s.clone())]),
        Value::Object(o) => {
            if o.get("multimodal_data").is_some_and(|m| !m.is_null()) {
                return Err("`multimodal_data`: this server reads text only".into());
            }
            match o.get("prompt_string") {
                Some(Value::String(s)) => Ok(vec![Part::Text(s.clone())]),
                _ => Err("a prompt object needs `prompt_string` (a text)".into()),
            }
        }
        Value::Array(items) => items
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(Part::Text(s.clone())),
                x => x.as_i64().map(Part::Id).ok_or_else(|| format!("{x} is neither a token id nor a text")),
            })
            .collect(),
        x => Err(format!("a prompt is a text, a list of token ids and texts, or a list of those; got {x}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Prompts, String> {
        Prompts::try_from(v)
    }

    #[test]
    fn llama_servers_prompt_shapes() {
        use Part::*;
        assert_eq!(parse(json!("hi")).unwrap().0, vec![vec![Text("hi".into())]]);
        assert_eq!(parse(json!([1, 2])).unwrap().0, vec![vec![Id(1), Id(2)]]);
        // ids with texts among them: one prompt
        assert_eq!(parse(json!([1, "a", 2])).unwrap().0, vec![vec![Id(1), Text("a".into()), Id(2)]]);
        // texts only, or lists: several prompts
        assert_eq!(parse(json!(["a", "b"])).unwrap().0, vec![vec![Text("a".into())], vec![Text("b".into())]]);
        assert_eq!(
            parse(json!([[1, 2], "b", {"prompt_string": "c"}])).unwrap().0,
            vec![vec![Id(1), Id(2)], vec![Text("b".into())], vec![Text("c".into())]]
        );
    }

    #[test]
    fn bad_prompts_say_why() {
        assert!(parse(json!([])).unwrap_err().contains("empty"));
        assert!(parse(json!(3.5)).unwrap_err().contains("a prompt is"));
        assert!(parse(json!([[1, 2.5]])).unwrap_err().contains("2.5"));
        assert!(parse(json!({"prompt_string": "a", "multimodal_data": ["x"]})).unwrap_err().contains("multimodal"));
        assert!(parse(json!(vec!["a"; MAX_PROMPTS + 1])).unwrap_err().contains("at most"));
    }
}
