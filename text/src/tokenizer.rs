//! Tokenizers: any Hugging Face `tokenizer.json` (through the `tokenizers`
//! crate), and the built-in character-level vocabulary of the tiny model.

use std::path::Path;

use serde_json::{Value, json};

use crate::error::{Result, TextError};

/// Padding token of the built-in vocabulary (id 0).
pub const BUILTIN_PAD: &str = "<pad>";
/// Beginning-of-sequence token of the built-in vocabulary (id 1).
pub const BUILTIN_BOS: &str = "<bos>";
/// End-of-sequence token of the built-in vocabulary (id 2).
pub const BUILTIN_EOS: &str = "<eos>";
/// Unknown-character token of the built-in vocabulary (id 3).
pub const BUILTIN_UNK: &str = "<unk>";

/// The characters of the built-in vocabulary, after the four special tokens
/// (ids 4...): space and newline, digits, ASCII letters and the punctuation
/// the built-in tasks use (arithmetic, lists, "sort:" / "reverse:" prompts).
pub const BUILTIN_CHARS: &str = " \n0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-*/%=()[]{},.:;!?<>_'\"#&|^~@$";

/// A tokenizer, together with the exact `tokenizer.json` text it was loaded
/// from (written back unchanged when the model is saved).
#[derive(Clone)]
pub struct PolicyTokenizer {
    inner: tokenizers::Tokenizer,
    json: String,
}

impl std::fmt::Debug for PolicyTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyTokenizer")
            .field("vocab_size", &self.vocab_size())
            .finish()
    }
}

impl PolicyTokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let json = std::fs::read_to_string(path).map_err(|e| TextError::io(path, e))?;
        Self::from_json(json).map_err(|e| match e {
            TextError::TokenizerLib { source, .. } => TextError::TokenizerLib {
                what: format!("cannot load {}", path.display()),
                source,
            },
            other => other,
        })
    }

    /// Parses the text of a `tokenizer.json`.
    pub fn from_json(json: String) -> Result<Self> {
        let inner: tokenizers::Tokenizer =
            json.parse()
                .map_err(|source: tokenizers::Error| TextError::TokenizerLib {
                    what: "cannot parse tokenizer.json".into(),
                    source,
                })?;
        Ok(Self { inner, json })
    }

    /// The character-level tokenizer of the built-in tiny model: `<pad>` = 0,
    /// `<bos>` = 1, `<eos>` = 2, `<unk>` = 3, then one token per character of
    /// [`BUILTIN_CHARS`]. It is a BPE model without merges (so every character
    /// is one token) with a `Fuse` decoder, which Hugging Face's
    /// `PreTrainedTokenizerFast` opens as well.
    pub fn builtin() -> Self {
        let specials = [BUILTIN_PAD, BUILTIN_BOS, BUILTIN_EOS, BUILTIN_UNK];
        let mut vocab = serde_json::Map::new();
        let mut added = Vec::new();
        for (id, tok) in specials.iter().enumerate() {
            vocab.insert((*tok).to_owned(), json!(id));
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true
            }));
        }
        for (i, c) in BUILTIN_CHARS.chars().enumerate() {
            vocab.insert(c.to_string(), json!(specials.len() + i));
        }
        let value = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": null,
            "post_processor": null,
            "decoder": {"type": "Fuse"},
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": BUILTIN_UNK,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": Value::Object(vocab),
                "merges": [],
            }
        });
        let json = serde_json::to_string_pretty(&value).unwrap_or_default();
        // The JSON above is fixed and known to parse; a failure here is a bug.
        #[allow(clippy::expect_used)]
        Self::from_json(json).expect("the built-in tokenizer.json parses")
    }

    /// The number of tokens, added (special) tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Token ids of `text`. `add_special_tokens` applies the tokenizer's
    /// post-processor (for example a BOS that a Llama tokenizer prepends);
    /// the built-in tokenizer has none, so callers prepend BOS themselves.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|source| TextError::TokenizerLib {
                what: "cannot encode".into(),
                source,
            })?;
        Ok(enc.get_ids().iter().map(|&id| i64::from(id)).collect())
    }

    /// The text of `ids`; ids outside the vocabulary are an error.
    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids: Vec<u32> = ids
            .iter()
            .map(|&id| {
                u32::try_from(id)
                    .map_err(|_| TextError::Tokenizer(format!("token id {id} is out of range")))
            })
            .collect::<Result<_>>()?;
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(|source| TextError::TokenizerLib {
                what: "cannot decode".into(),
                source,
            })
    }

    /// The id of a token (special tokens included), if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(i64::from)
    }

    /// The token text of an id.
    pub fn id_to_token(&self, id: i64) -> Option<String> {
        u32::try_from(id)
            .ok()
            .and_then(|id| self.inner.id_to_token(id))
    }

    /// The `tokenizer.json` text (as loaded).
    pub fn json(&self) -> &str {
        &self.json
    }

    /// The wrapped `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_is_char_level_and_round_trips() {
        let t = PolicyTokenizer::builtin();
        assert_eq!(t.vocab_size(), 4 + BUILTIN_CHARS.chars().count());
        assert_eq!(t.token_to_id(BUILTIN_PAD), Some(0));
        assert_eq!(t.token_to_id(BUILTIN_BOS), Some(1));
        assert_eq!(t.token_to_id(BUILTIN_EOS), Some(2));
        let text = "37+58=95\nsort: 3 1 2";
        let ids = t.encode(text, false).unwrap();
        assert_eq!(ids.len(), text.chars().count());
        assert_eq!(t.decode(&ids, false).unwrap(), text);
        // special tokens in the text are recognised and skippable
        let ids = t.encode("<bos>1+1=2<eos>", false).unwrap();
        assert_eq!(ids.first(), Some(&1));
        assert_eq!(ids.last(), Some(&2));
        assert_eq!(t.decode(&ids, true).unwrap(), "1+1=2");
        // unknown characters map to <unk>
        assert_eq!(t.encode("é", false).unwrap(), vec![3]);
        assert!(t.decode(&[-1], false).is_err());
    }
}
