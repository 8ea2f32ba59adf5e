//! A `tokenizer` folder from a stranger (vocab.json, merges.txt, tokenizer_config.json, or
//! tokenizer.json): loading gives a tokenizer or an error, and a loaded one encodes prompts to
//! exactly its fixed length, never panicking.

use oxidiff_models::tokenizer::ClipTokenizer;

/// The input is split at 0xff bytes into the files of the folder.
const FILES: [&str; 4] = [
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "tokenizer.json",
];

/// One input: returns normally or panics (a finding).
pub fn run(data: &[u8]) {
    let dir = tempfile::tempdir_in(std::env::temp_dir()).expect("temp dir");
    for (name, part) in FILES.iter().zip(data.split(|&b| b == 0xff)) {
        if !part.is_empty() {
            std::fs::write(dir.path().join(name), part).expect("write");
        }
    }
    if let Ok(tok) = ClipTokenizer::from_dir(dir.path()) {
        for prompt in [
            "a photo of an astronaut",
            "",
            "ünïcödé!!! 城堡 <|endoftext|>",
        ] {
            if let Ok(encoded) = tok.encode(prompt) {
                assert_eq!(encoded.ids.len(), tok.max_length());
            }
        }
    }
}
