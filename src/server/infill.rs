//! `POST /infill`: llama-server's code infilling, the route editor plug-ins (llama.vscode,
//! llama.vim) call. The prompt is built from the model's fill-in-the-middle tokens exactly as
//! llama-server builds it (`format_prompt_infill`), so the same request decodes the same tokens:
//!
//! `[extra context] [BOS] FIM_PRE prefix prompt FIM_SUF suffix FIM_MID`
//!
//! where the extra context uses the repository-level pattern when the vocabulary has FIM_REP and
//! FIM_SEP (`FIM_REP myproject\n FIM_SEP filename\n text ... FIM_SEP filename\n`), and llama-server's
//! fitting: the prefix keeps its last 3/4 of a 2,048-token batch, the suffix what is left of a
//! quarter, and the extra context (its end) what the context holds beyond a batch and twice the
//! answer.

use super::errors::ApiError;
use super::types::InfillRequest;
use crate::llama::{FimTokens, Model, Token};

/// llama-server's default `n_batch`, which its fitting is expressed in.
const BATCH: usize = 2048;

/// The prompt tokens of an infill request for a context of `n_ctx` and an answer of at most
/// `n_predict` tokens (None: no limit, which llama-server writes as -1).
pub fn prompt(model: &Model, req: &InfillRequest, n_ctx: usize, n_predict: Option<usize>) -> Result<Vec<Token>, ApiError> {
    let fim = model.fim_tokens();
    let (Some(pre), Some(suf), Some(mid)) = (fim.pre, fim.suf, fim.mid) else {
        return Err(ApiError::Unsupported(format!(
            "infill is not supported by this model: it has no fill-in-the-middle tokens ({})",
            model.path()
        )));
    };
    let tokenize = |text: &str| model.tokenize(text, false, false).map_err(|e| ApiError::invalid(e.to_string()));
    let extra = extra_context(&fim, req, &tokenize)?;
    let mut prefix = tokenize(&req.input_prefix)?;
    let mut suffix = tokenize(&req.input_suffix)?;
    let prompt = tokenize(&req.prompt)?;

    let prefix_take = prefix.len().min(3 * (BATCH / 4));
    let suffix_take = suffix.len().min((BATCH / 4).saturating_sub(2 + prompt.len()));
    let reserve = BATCH as i64 + 2 * n_predict.map_or(-1, |n| n as i64);
    let extra_take = extra.len().min((n_ctx as i64 - reserve).max(0) as usize);
    prefix.drain(..prefix.len() - prefix_take);
    suffix.truncate(suffix_take);

    let mut out = extra[extra.len() - extra_take..].to_vec();
    out.extend(model.adds_bos());
    out.push(pre);
    out.extend(prefix);
    out.extend(prompt);
    out.push(suf);
    out.extend(suffix);
    out.push(mid);
    Ok(out)
}

/// The `input_extra` chunks as llama-server lays them out before the FIM prefix.
fn extra_context(
    fim: &FimTokens,
    req: &InfillRequest,
    tokenize: &impl Fn(&str) -> Result<Vec<Token>, ApiError>,
) -> Result<Vec<Token>, ApiError> {
    let mut out = Vec::new();
    if let Some(rep) = fim.rep {
        out.push(rep);
        out.extend(tokenize("myproject\n")?);
    }
    for chunk in &req.input_extra {
        match fim.sep {
            Some(sep) => {
                out.push(sep);
                out.extend(tokenize(&format!("{}\n", chunk.filename))?);
            }
            // llama-server's chunk separator where the model has no file separator
            None => out.extend(tokenize("\n\n--- snippet ---\n\n")?),
        }
        out.extend(tokenize(&chunk.text)?);
    }
    if let Some(sep) = fim.sep {
        out.push(sep);
        out.extend(tokenize("filename\n")?);
    }
    Ok(out)
}
