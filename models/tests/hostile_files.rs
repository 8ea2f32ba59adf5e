//! Hostile and damaged checkpoint files: each gives a precise error that names the file and the
//! fault, never a panic or an allocation sized by an untrusted header.

use std::path::{Path, PathBuf};

use oxidiff_models::weights::Weights;

/// A safetensors file from a raw header string and data bytes.
fn file_bytes(header: &str, data: &[u8]) -> Vec<u8> {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend_from_slice(data);
    bytes
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

/// Opens `bytes` as a safetensors file and returns the error message, which must name the file.
fn open_error(bytes: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "model.safetensors", bytes);
    let err = Weights::from_files(std::slice::from_ref(&path))
        .expect_err("a hostile file must not load")
        .to_string();
    assert!(
        err.contains(&path.display().to_string()),
        "error does not name the file: {err}"
    );
    err
}

fn assert_mentions(err: &str, parts: &[&str]) {
    for part in parts {
        assert!(err.contains(part), "expected {part:?} in: {err}");
    }
}

#[test]
fn a_valid_file_still_loads() {
    let data: Vec<u8> = [1.5f32, -2.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let bytes = file_bytes(
        r#"{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        &data,
    );
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ok.safetensors", &bytes);
    let weights = Weights::from_files(&[path]).unwrap();
    assert_eq!(weights.read_f32("w").unwrap(), (vec![1.5, -2.0], vec![2]));
}

#[test]
fn file_shorter_than_the_length_field() {
    let err = open_error(&[1, 2, 3, 4, 5]);
    assert_mentions(&err, &["5 bytes long", "8-byte header length"]);
}

#[test]
fn header_length_larger_than_the_file() {
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    let err = open_error(&bytes);
    assert_mentions(&err, &["says 1000 bytes", "only 2 bytes follow"]);
}

#[test]
fn header_over_the_size_limit() {
    // A sparse file: 150 MB that take no disk space, all but the length field zeros.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.safetensors");
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(150_000_000).unwrap();
    drop(file);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, &120_000_000u64.to_le_bytes()).unwrap();
    drop(f);
    let err = Weights::from_files(std::slice::from_ref(&path))
        .unwrap_err()
        .to_string();
    assert_mentions(&err, &["120000000 bytes", "limit of 100000000"]);
}

#[test]
fn header_not_utf8() {
    let mut bytes = 4u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(&[b'{', 0xff, 0xfe, b'}']);
    assert_mentions(&open_error(&bytes), &["not UTF-8", "offset 1"]);
}

#[test]
fn header_deeply_nested() {
    let header = format!("{{\"w\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let err = open_error(&file_bytes(&header, &[]));
    assert_mentions(&err, &["not a valid JSON object", "recursion limit"]);
}

#[test]
fn header_not_an_object() {
    let err = open_error(&file_bytes("[1, 2]", &[]));
    assert_mentions(&err, &["not a valid JSON object"]);
}

#[test]
fn unknown_dtype() {
    let header = r#"{"w":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}"#;
    let err = open_error(&file_bytes(header, &[0; 16]));
    assert_mentions(&err, &["tensor `w`", "unknown dtype `F128`"]);
}

#[test]
fn wrong_json_types_in_an_entry() {
    let header = r#"{"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}}"#;
    let err = open_error(&file_bytes(header, &[0; 8]));
    assert_mentions(&err, &["tensor `w`", "`shape` is missing or not a list"]);
    let header = r#"{"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}}"#;
    let err = open_error(&file_bytes(header, &[0; 8]));
    assert_mentions(&err, &["shape entry -2 is not a non-negative integer"]);
}

#[test]
fn overlapping_offsets() {
    let header = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                     "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let err = open_error(&file_bytes(header, &[0; 12]));
    assert_mentions(&err, &["tensors `a` and `b` overlap", "starts at byte 4"]);
}

#[test]
fn a_gap_between_tensors() {
    let header = r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                     "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#;
    let err = open_error(&file_bytes(header, &[0; 12]));
    assert_mentions(&err, &["bytes [4, 8) of the data belong to no tensor"]);
}

#[test]
fn offsets_past_the_end_of_the_file() {
    let header = r#"{"w":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}"#;
    let err = open_error(&file_bytes(header, &[0; 8]));
    assert_mentions(
        &err,
        &["tensor `w`", "[0, 400) reach past the end", "8 bytes"],
    );
}

#[test]
fn dtype_and_shape_disagree_with_the_byte_length() {
    let header = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    let err = open_error(&file_bytes(header, &[0; 8]));
    assert_mentions(&err, &["tensor `w`", "need 12 bytes", "span 8"]);
}

#[test]
fn absurd_shape_is_refused_before_allocating() {
    // 2^96 elements: no loader may try to allocate this.
    let header =
        r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}"#;
    let err = open_error(&file_bytes(header, &[0; 8]));
    assert_mentions(&err, &["tensor `w`", "span 8"]);
}

#[test]
fn duplicate_tensor_names() {
    let header = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
                     "w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let err = open_error(&file_bytes(header, &[0; 4]));
    assert_mentions(&err, &["tensor `w` is listed twice"]);
}

/// Found by `tests/fuzz_replay.rs`: the header check passed an entry naming `shape` twice,
/// which the safetensors crate then refused with a serde message.
#[test]
fn a_field_given_twice_in_one_entry() {
    let header = r#"{"w":{"dtype":"F32","shape":[2],"shape":[1],"data_offsets":[0,4]}}"#;
    let err = open_error(&file_bytes(header, &[0; 4]));
    assert_mentions(&err, &["entry `w` gives `shape` twice"]);
}

#[test]
fn trailing_bytes_after_the_last_tensor() {
    let header = r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let err = open_error(&file_bytes(header, &[0; 16]));
    assert_mentions(&err, &["cover 4 bytes of data, but the file holds 16"]);
}

#[test]
fn metadata_that_is_not_strings() {
    let header = r#"{"__metadata__":{"format":{"nested":1}},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#;
    let err = open_error(&file_bytes(header, &[0; 4]));
    assert_mentions(&err, &["`__metadata__` entry `format` is not a string"]);
}

// Config files with wrong types, impossible sizes and absurd numbers.

use oxidiff_models::autoencoder_kl::AutoencoderKLConfig;
use oxidiff_models::tokenizer::ClipTokenizer;
use oxidiff_models::unet_2d_condition::UNet2DConditionConfig;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

/// The tiny SD1 UNet config with `edit` applied, parsed from a temporary file.
fn unet_config_error(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    config_error(
        "tiny-sd1/unet/config.json",
        edit,
        UNet2DConditionConfig::from_file,
    )
}

fn config_error<T: std::fmt::Debug, E: std::fmt::Display>(
    rel: &str,
    edit: impl FnOnce(&mut serde_json::Value),
    parse: impl Fn(&Path) -> Result<T, E>,
) -> String {
    let text = std::fs::read_to_string(fixture(rel)).unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(
        parse(&fixture(rel)).is_ok(),
        "the unedited config must parse"
    );
    edit(&mut value);
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "config.json", value.to_string().as_bytes());
    let err = parse(&path)
        .expect_err("the edited config must be refused")
        .to_string();
    assert!(err.contains(&path.display().to_string()), "{err}");
    err
}

#[test]
fn unet_config_with_zero_groups_or_heads() {
    let err = unet_config_error(|v| v["norm_num_groups"] = 0.into());
    assert_mentions(&err, &["`norm_num_groups: 0` must be positive"]);
    let err = unet_config_error(|v| v["norm_num_groups"] = 5.into());
    assert_mentions(&err, &["`norm_num_groups: 5`", "found 16"]);
    let err = unet_config_error(|v| v["attention_head_dim"] = 0.into());
    assert_mentions(
        &err,
        &["16 channels cannot be split into 0 attention heads"],
    );
    let err = unet_config_error(|v| v["attention_head_dim"] = 3.into());
    assert_mentions(&err, &["cannot be split into 3 attention heads"]);
}

#[test]
fn unet_config_with_absurd_numbers() {
    // Counts that would build billions of layers, negative counts, floats where counts go,
    // strings where numbers go: all named errors.
    let err = unet_config_error(|v| v["layers_per_block"] = u64::MAX.into());
    assert_mentions(
        &err,
        &["`layers_per_block: 18446744073709551615`", "at most 64"],
    );
    let err = unet_config_error(|v| v["transformer_layers_per_block"] = 1_000_000.into());
    assert_mentions(
        &err,
        &["`transformer_layers_per_block: 1000000`", "at most 64"],
    );
    let err = unet_config_error(|v| v["cross_attention_dim"] = "32".into());
    assert_mentions(&err, &["field `cross_attention_dim`"]);
    let err = unet_config_error(|v| v["in_channels"] = (-4).into());
    assert_mentions(&err, &["field `in_channels`"]);
    let err =
        unet_config_error(|v| v["block_out_channels"] = serde_json::json!([16.5, 16, 32, 32]));
    assert_mentions(&err, &["field `block_out_channels"]);
    let err = unet_config_error(|v| {
        v.as_object_mut().unwrap().remove("block_out_channels");
        v["down_block_types"] = serde_json::json!([]);
        v["up_block_types"] = serde_json::json!([]);
    });
    assert_mentions(&err, &["must have the same, non-zero length"]);
}

#[test]
fn vae_config_with_absurd_sizes() {
    let err = config_error(
        "tiny-sd1/vae/config.json",
        |v| {
            let n = 70;
            v["block_out_channels"] = serde_json::json!(vec![16; n]);
            v["down_block_types"] = serde_json::json!(vec!["DownEncoderBlock2D"; n]);
            v["up_block_types"] = serde_json::json!(vec!["UpDecoderBlock2D"; n]);
        },
        AutoencoderKLConfig::from_file,
    );
    assert_mentions(&err, &["70 VAE blocks"]);
    let err = config_error(
        "tiny-sd1/vae/config.json",
        |v| v["norm_num_groups"] = 0.into(),
        AutoencoderKLConfig::from_file,
    );
    assert_mentions(&err, &["`norm_num_groups: 0`"]);
}

// Malformed tokenizer files.

/// A copy of the tiny SD1 tokenizer folder with `name` replaced by `contents`.
fn tokenizer_error(name: &str, contents: &[u8]) -> String {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture("tiny-sd1/tokenizer")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    assert!(ClipTokenizer::from_dir(dir.path()).is_ok());
    write(dir.path(), name, contents);
    let err = ClipTokenizer::from_dir(dir.path())
        .expect_err("a malformed tokenizer must be refused")
        .to_string();
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    err
}

#[test]
fn malformed_tokenizer_files() {
    assert_mentions(&tokenizer_error("vocab.json", b"{not json"), &["vocab"]);
    assert_mentions(
        &tokenizer_error("vocab.json", br#"{"a": 0, "b": 1}"#),
        &["vocab.json + merges.txt", "out of vocabulary"],
    );
    assert_mentions(
        &tokenizer_error("merges.txt", b"#version: 0.2\nonly_one_token\n"),
        &["merges"],
    );
    assert_mentions(
        &tokenizer_error("tokenizer.json", b"\xff\xfe garbage"),
        &["tokenizer.json"],
    );
    assert_mentions(
        &tokenizer_error(
            "tokenizer_config.json",
            br#"{"model_max_length": "seventy-seven"}"#,
        ),
        &["model_max_length"],
    );
}

// Links out of the model folder.

#[cfg(unix)]
#[test]
fn a_weights_link_out_of_the_model_folder_is_refused() {
    let outside = tempfile::tempdir().unwrap();
    let secret = write(
        outside.path(),
        "secret.safetensors",
        &file_bytes(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ),
    );
    let model = tempfile::tempdir().unwrap();
    let unet = model.path().join("unet");
    std::fs::create_dir_all(&unet).unwrap();
    let link = unet.join("diffusion_pytorch_model.safetensors");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let err = Weights::from_component_dir(&unet, &["diffusion_pytorch_model"], None)
        .unwrap_err()
        .to_string();
    assert_mentions(
        &err,
        &[
            &link.display().to_string(),
            "outside the model folder",
            "secret.safetensors",
        ],
    );
}

#[cfg(unix)]
#[test]
fn hub_cache_links_into_the_repositorys_blobs_load() {
    // The real Hub layout: snapshots/REV/unet/file -> ../../../blobs/SHA.
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--org--name");
    let blobs = repo.join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let data: Vec<u8> = 2.5f32.to_le_bytes().to_vec();
    write(
        &blobs,
        "0a1b2c",
        &file_bytes(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
            &data,
        ),
    );
    let unet = repo.join("snapshots/0123abcd/unet");
    std::fs::create_dir_all(&unet).unwrap();
    std::os::unix::fs::symlink(
        "../../../blobs/0a1b2c",
        unet.join("diffusion_pytorch_model.safetensors"),
    )
    .unwrap();
    let weights = Weights::from_component_dir(&unet, &["diffusion_pytorch_model"], None).unwrap();
    assert_eq!(weights.read_f32("w").unwrap(), (vec![2.5], vec![1]));
}

/// Opens `text` as a weights header ([`Weights::from_header`]) and returns the error message,
/// which must name the file.
fn header_error(text: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "model.header.json", text.as_bytes());
    let err = Weights::from_header(&path)
        .expect_err("a bad header must not open")
        .to_string();
    assert!(
        err.contains(&path.display().to_string()),
        "error does not name the file: {err}"
    );
    err
}

#[test]
fn a_weights_header_gives_the_checkpoints_tensors_as_zeros() {
    use burn::tensor::FloatDType;
    // A real checkpoint's header, cut out of the file, opens as the checkpoint's tensors.
    let checkpoint = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/tiny-sd1/unet/diffusion_pytorch_model.safetensors");
    let bytes = std::fs::read(&checkpoint).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "unet.header.json", &bytes[8..8 + n]);
    let header = Weights::from_header(&path).unwrap();
    let full = Weights::from_files(&[checkpoint]).unwrap();
    let mut keys: Vec<&str> = header.keys().collect();
    let mut expected: Vec<&str> = full.keys().collect();
    keys.sort_unstable();
    expected.sort_unstable();
    assert_eq!(keys, expected);
    for key in &keys {
        assert_eq!(header.shape(key), full.shape(key), "{key}");
        let data = header.read(key, FloatDType::BF16).unwrap();
        assert_eq!(data.shape.to_vec(), full.shape(key).unwrap().to_vec());
        assert!(data
            .as_slice::<half::bf16>()
            .unwrap()
            .iter()
            .all(|v| v.to_f32() == 0.0));
    }
}

#[test]
fn damaged_weights_headers_are_refused() {
    let entry = |dtype: &str, shape: &str, offsets: &str| {
        format!(r#"{{"w": {{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}}}"#)
    };
    for (text, fault) in [
        ("not json".to_string(), "expected"),
        (entry("F32", "[2, 2]", "[0, 12]"), "w"),
        (entry("Q9", "[2]", "[0, 8]"), "Q9"),
        (entry("F16", "[2]", "[4, 8]"), "w"),
        (
            r#"{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                "b": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}"#
                .to_string(),
            "invalid offset for tensor",
        ),
    ] {
        let err = header_error(&text);
        assert_mentions(&err, &["not a valid weights header", fault]);
    }
    // Larger than any header (a sparse file): refused before it is read.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("huge.header.json");
    std::fs::File::create(&path)
        .and_then(|f| f.set_len(100_000_001))
        .unwrap();
    let err = Weights::from_header(&path).unwrap_err().to_string();
    assert_mentions(&err, &[&path.display().to_string(), "more than a header's"]);
}
