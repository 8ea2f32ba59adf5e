//! The one warning every pipeline gives when a prompt is cut to its text encoder's length, as
//! diffusers logs it: CLIP keeps its first tokens (the warning quotes what is used), T5 keeps
//! `max_sequence_length` tokens (the warning quotes what is dropped).

use oxidiff_models::{ClipTokenizer, Encoded, T5Tokenizer};

use crate::error::Result;

/// Warns when `encoded` (from `tokenizer`) was cut to CLIP's length.
pub(crate) fn warn_if_clip_cut(tokenizer: &ClipTokenizer, encoded: &Encoded) {
    if encoded.truncated {
        let kept = tokenizer.decode(&encoded.ids).unwrap_or_default();
        tracing::warn!(
            "the prompt is longer than CLIP's {} tokens and was cut; only this part is used: \
             {kept:?}",
            tokenizer.max_length()
        );
    }
}

/// Warns, when `text` is longer than `max_sequence_length` T5 tokens, which part is dropped.
pub(crate) fn warn_if_t5_cut(
    tokenizer: &T5Tokenizer,
    text: &str,
    max_sequence_length: usize,
    truncated: bool,
) -> Result<()> {
    if truncated {
        let all = tokenizer.tokenize(text)?;
        let removed = tokenizer
            .decode(&all[max_sequence_length.saturating_sub(1)..])
            .unwrap_or_default();
        tracing::warn!(
            "the prompt is longer than max_sequence_length ({max_sequence_length} T5 tokens) and \
             was cut; this part is not used: {removed:?}"
        );
    }
    Ok(())
}
