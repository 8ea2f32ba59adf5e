//! The CLIP tokenizer, from a checkpoint's own `tokenizer` folder.
//!
//! Real Stable Diffusion checkpoints ship the slow-tokenizer files (`vocab.json`, `merges.txt`,
//! `tokenizer_config.json`); some also ship `tokenizer.json`. Both are read with the `tokenizers`
//! crate: from `vocab.json` + `merges.txt` the tokenizer is assembled as transformers' CLIP
//! converter does (NFC, whitespace collapse, lower case, CLIP's split regex, byte-level BPE with
//! the `</w>` suffix). Prompts are framed by start/end tokens, then truncated or padded to
//! `model_max_length` (77).

use std::path::{Path, PathBuf};

use serde::Deserialize;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::{Lowercase, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use crate::config::load_json;
use crate::error::{ModelError, Result};

const CLIP_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+";

/// A special token as `tokenizer_config.json` writes it: a string or an `AddedToken` object.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum TokenSpec {
    Plain(String),
    Object { content: String },
}

impl TokenSpec {
    fn content(&self) -> &str {
        match self {
            Self::Plain(s) => s,
            Self::Object { content } => content,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
struct TokenizerConfig {
    model_max_length: Option<f64>,
    bos_token: Option<TokenSpec>,
    eos_token: Option<TokenSpec>,
    pad_token: Option<TokenSpec>,
}

/// One prompt, tokenized to a fixed length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    /// True when the prompt was longer than the model accepts and its end was cut.
    pub truncated: bool,
}

/// CLIP's tokenizer with the padding and truncation the pipelines use.
#[derive(Debug, Clone)]
pub struct ClipTokenizer {
    tokenizer: Tokenizer,
    bos: u32,
    eos: u32,
    pad: u32,
    max_length: usize,
    dir: PathBuf,
}

impl ClipTokenizer {
    /// Reads a `tokenizer` folder: `tokenizer.json`, or `vocab.json` + `merges.txt`, with
    /// `tokenizer_config.json` for the length and special tokens.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let err = |reason: String| ModelError::Tokenizer {
            path: dir.to_path_buf(),
            reason,
        };
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if config_path.is_file() {
            load_json(&config_path)?
        } else {
            TokenizerConfig::default()
        };
        let json = dir.join("tokenizer.json");
        let vocab = dir.join("vocab.json");
        let merges = dir.join("merges.txt");
        let mut tokenizer = if json.is_file() {
            Tokenizer::from_file(&json).map_err(|e| err(format!("tokenizer.json: {e}")))?
        } else if vocab.is_file() && merges.is_file() {
            // Parsed once by us first, so a damaged vocab.json is named with its JSON fault.
            load_json::<std::collections::HashMap<String, u32>>(&vocab)?;
            Self::build_bpe(&vocab, &merges)
                .map_err(|e| err(format!("vocab.json + merges.txt: {e}")))?
        } else {
            return Err(err(
                "neither tokenizer.json nor vocab.json + merges.txt found; is this the \
                 `tokenizer` folder of a diffusers checkpoint?"
                    .into(),
            ));
        };
        let name = |spec: &Option<TokenSpec>, default: &str| {
            spec.as_ref()
                .map(|s| s.content().to_string())
                .unwrap_or_else(|| default.to_string())
        };
        let bos_name = name(&config.bos_token, "<|startoftext|>");
        let eos_name = name(&config.eos_token, "<|endoftext|>");
        let pad_name = name(&config.pad_token, &eos_name);
        // transformers registers bos, eos and pad as special tokens: they match literally in a
        // prompt (SD 2.x pads with "!", so a "!" in a prompt becomes the pad id).
        tokenizer.add_special_tokens(&[
            AddedToken::from(bos_name.clone(), true),
            AddedToken::from(eos_name.clone(), true),
            AddedToken::from(pad_name.clone(), true),
        ]);
        let id = |token: &str| {
            tokenizer
                .token_to_id(token)
                .ok_or_else(|| err(format!("token `{token}` is not in the vocabulary")))
        };
        let max_length = match config.model_max_length {
            // transformers writes a huge sentinel when no limit is set; CLIP's is 77.
            Some(n) if (1.0..=4096.0).contains(&n) => n as usize,
            _ => 77,
        };
        Ok(Self {
            bos: id(&bos_name)?,
            eos: id(&eos_name)?,
            pad: id(&pad_name)?,
            tokenizer,
            max_length,
            dir: dir.to_path_buf(),
        })
    }

    fn build_bpe(vocab: &Path, merges: &Path) -> tokenizers::Result<Tokenizer> {
        let bpe = BPE::from_file(&vocab.to_string_lossy(), &merges.to_string_lossy())
            .end_of_word_suffix("</w>".into())
            .unk_token("<|endoftext|>".into())
            .build()?;
        let mut tokenizer = Tokenizer::new(bpe);
        tokenizer.with_normalizer(Some(NormalizerSequence::new(vec![
            NFC.into(),
            Replace::new(
                tokenizers::normalizers::replace::ReplacePattern::Regex(r"\s+".into()),
                " ",
            )?
            .into(),
            Lowercase.into(),
        ])));
        tokenizer.with_pre_tokenizer(Some(PreTokenizerSequence::new(vec![
            Split::new(
                SplitPattern::Regex(CLIP_SPLIT.into()),
                SplitDelimiterBehavior::Removed,
                true,
            )?
            .into(),
            ByteLevel::new(false, true, false).into(),
        ])));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        Ok(tokenizer)
    }

    /// The fixed length prompts are padded to (`model_max_length`).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Token ids of `text` without start/end tokens or padding.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        plain_ids(&self.tokenizer, &self.dir, text)
    }

    /// `[bos] tokens [eos]`, truncated to `max_length` (keeping the end token) and padded.
    pub fn encode(&self, text: &str) -> Result<Encoded> {
        let tokens = self.tokenize(text)?;
        let room = self.max_length.saturating_sub(2);
        let truncated = tokens.len() > room;
        let mut ids = Vec::with_capacity(self.max_length);
        ids.push(self.bos);
        ids.extend(tokens.into_iter().take(room));
        ids.push(self.eos);
        ids.resize(self.max_length, self.pad);
        Ok(Encoded { ids, truncated })
    }

    /// Turns ids back into text (special tokens dropped), for messages about cut prompts.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let text = self
            .tokenizer
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer {
                path: self.dir.clone(),
                reason: e.to_string(),
            })?;
        Ok(text.replace("</w>", " ").trim_end().to_string())
    }
}

/// One prompt for an encoder that masks padding (T5): ids padded to a fixed length and the
/// mask of real tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskedTokens {
    pub ids: Vec<u32>,
    /// 1 for each token of the prompt (its end token included), 0 for padding.
    pub attention_mask: Vec<u32>,
    /// How many tokens the prompt has before truncation, its end token included.
    pub untruncated_len: usize,
}

impl MaskedTokens {
    /// True when the prompt was cut to fit.
    pub fn truncated(&self) -> bool {
        self.untruncated_len > self.ids.len()
    }
}

/// The T5 tokenizer (a SentencePiece unigram model) from a checkpoint's `tokenizer.json`, with
/// transformers' `T5TokenizerFast` framing: the tokens, then `</s>`, then `<pad>` padding.
#[derive(Debug, Clone)]
pub struct T5Tokenizer {
    tokenizer: Tokenizer,
    eos: u32,
    pad: u32,
    dir: PathBuf,
}

impl T5Tokenizer {
    /// Reads a `tokenizer` folder: `tokenizer.json`, with `tokenizer_config.json` for the names
    /// of the end and padding tokens.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let err = |reason: String| ModelError::Tokenizer {
            path: dir.to_path_buf(),
            reason,
        };
        let json = dir.join("tokenizer.json");
        if !json.is_file() {
            let hint = if dir.join("spiece.model").is_file() {
                "the folder has only the SentencePiece file spiece.model; write tokenizer.json next \
                 to it once with transformers: `T5TokenizerFast.from_pretrained(dir).save_pretrained(dir)`"
            } else {
                "tokenizer.json not found; is this the `tokenizer` folder of a diffusers checkpoint?"
            };
            return Err(err(hint.into()));
        }
        let tokenizer =
            Tokenizer::from_file(&json).map_err(|e| err(format!("tokenizer.json: {e}")))?;
        let config_path = dir.join("tokenizer_config.json");
        let config: TokenizerConfig = if config_path.is_file() {
            load_json(&config_path)?
        } else {
            TokenizerConfig::default()
        };
        let name = |spec: &Option<TokenSpec>, default: &str| {
            spec.as_ref()
                .map(|s| s.content().to_string())
                .unwrap_or_else(|| default.to_string())
        };
        let id = |token: &str| {
            tokenizer
                .token_to_id(token)
                .ok_or_else(|| err(format!("token `{token}` is not in the vocabulary")))
        };
        Ok(Self {
            eos: id(&name(&config.eos_token, "</s>"))?,
            pad: id(&name(&config.pad_token, "<pad>"))?,
            tokenizer,
            dir: dir.to_path_buf(),
        })
    }

    pub fn pad_id(&self) -> u32 {
        self.pad
    }

    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// Token ids of `text` without the end token or padding.
    pub fn tokenize(&self, text: &str) -> Result<Vec<u32>> {
        plain_ids(&self.tokenizer, &self.dir, text)
    }

    /// `tokens </s>`, truncated to `max_length` (keeping `</s>`) and padded with `<pad>`, as
    /// `tokenizer(text, padding="max_length", max_length=.., truncation=True)` gives.
    pub fn encode(&self, text: &str, max_length: usize) -> Result<MaskedTokens> {
        if max_length == 0 {
            return Err(ModelError::Input(
                "the maximum sequence length must be at least 1".into(),
            ));
        }
        let tokens = self.tokenize(text)?;
        let untruncated_len = tokens.len() + 1;
        let mut ids: Vec<u32> = tokens.into_iter().take(max_length - 1).collect();
        ids.push(self.eos);
        let mut attention_mask = vec![1; ids.len()];
        attention_mask.resize(max_length, 0);
        ids.resize(max_length, self.pad);
        Ok(MaskedTokens {
            ids,
            attention_mask,
            untruncated_len,
        })
    }

    /// Turns ids back into text (special tokens dropped), for messages about cut prompts.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| ModelError::Tokenizer {
                path: self.dir.clone(),
                reason: e.to_string(),
            })
    }
}

/// Token ids of `text` as the tokenizer's model splits it, without special tokens.
fn plain_ids(tokenizer: &Tokenizer, dir: &Path, text: &str) -> Result<Vec<u32>> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| ModelError::Tokenizer {
            path: dir.to_path_buf(),
            reason: e.to_string(),
        })?;
    Ok(encoding.get_ids().to_vec())
}
