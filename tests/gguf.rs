//! Transformers from GGUF files against diffusers' own GGUF loading
//! (`from_single_file(..., quantization_config=GGUFQuantizationConfig(compute_dtype=float32))`):
//! one call and a whole schnell generation for Q8_0, Q4_0 and Q4_K files, with the weights kept
//! in their blocks and multiplied block by block; the same file under the original (BFL) key
//! names; an SD3 transformer's call and a whole tiny-sd3 generation for the same three types;
//! both generations again on XLA's CPU plugin, compiled, with the weights on the device as
//! integers and scales; what `memory()` reports; and a file that does not fit the config.
//! Fixtures of `tools/golden/make_gguf.py`.
//!
//! Tolerances, relative to the largest value: 1e-4 against diffusers' model holding gguf-py's
//! f32 dequantization of the file (f32 on both sides, equal weights, different summation
//! orders), and 2e-3 against diffusers' GGUF path itself: its CPU path dequantizes in f16 (its
//! `dequantize_blocks_*` keep the f16 scale's dtype, so every weight is rounded to f16 before
//! the f32 product), where oxidiff dequantizes in f32 as gguf-py and GGML do (bit for bit, see
//! `models/tests/gguf.rs`); that rounding moves the output by 3e-4 (Q8_0, Q4_0) to 1.2e-3
//! (Q4_K). PNG pixels within 2 levels of diffusers' PNG.

mod common;

use std::path::PathBuf;

use burn::tensor::{FloatDType, Tensor};
use common::{assert_close, fixtures, model_dir, Golden, B};
use oxidiff::models::{FluxTransformer2DModel, SD3Transformer2DModel};
use oxidiff::pipelines::{FluxPipeline, FluxRequest, GenerateRequest, LoadOptions};
use oxidiff::schedulers::TorchCpuGenerator;

const TOL: f32 = 1e-4;
/// Against diffusers' f16 dequantization (see above).
const TOL_DIFFUSERS: f32 = 2e-3;
const TYPES: [&str; 3] = ["Q8_0", "Q4_0", "Q4_K"];

fn gguf_dir() -> PathBuf {
    fixtures().join("tiny-flux-gguf")
}

fn load(file: &str) -> FluxTransformer2DModel<B> {
    let dir = gguf_dir();
    FluxTransformer2DModel::<B>::from_gguf_in(
        &dir.join(file),
        &dir.join("transformer"),
        FloatDType::F32,
        &Default::default(),
    )
    .unwrap()
}

fn call(golden: &Golden, model: &FluxTransformer2DModel<B>) -> Tensor<B, 3> {
    let device = Default::default();
    let (ids, shape) = golden.host("input.img_ids");
    let img_ids: Vec<Vec<f32>> = ids.chunks(shape[1]).map(<[f32]>::to_vec).collect();
    let rope = model.rotary_embedding(&vec![vec![0.0; 3]; 7], &img_ids, &device);
    model
        .forward(
            golden.tensor("input.hidden_states"),
            golden.tensor("input.encoder_hidden_states"),
            golden.tensor("input.pooled_projections"),
            golden.tensor("input.timestep"),
            None,
            &rope,
        )
        .unwrap()
}

#[test]
fn quantized_transformer_calls_match_diffusers_gguf() {
    let golden = Golden::load("gguf");
    for kind in TYPES {
        let model = load(&format!("flux-{kind}.gguf"));
        let quantized = model
            .transformer_blocks
            .first()
            .and_then(|b| b.attn.to_q.quantized.as_ref())
            .map(|q| q.kind().to_string());
        assert_eq!(quantized.as_deref(), Some(kind), "to_q kept in its blocks");
        let out = call(&golden, &model);
        assert_close(&golden, &format!("{kind}.out_f32"), out.clone(), TOL);
        assert_close(&golden, &format!("{kind}.out"), out, TOL_DIFFUSERS);
        // The product ran on the blocks: the dense weight was never made.
        assert!(!model.transformer_blocks[0]
            .attn
            .to_q
            .weight
            .is_initialized());
    }
}

#[test]
fn bfl_key_names_load_the_same_model() {
    let golden = Golden::load("gguf");
    let out = call(&golden, &load("flux-bfl-Q8_0.gguf"));
    assert_close(&golden, "Q8_0.out_f32", out, TOL);
}

#[test]
fn schnell_with_a_quantized_transformer_matches_diffusers_images() {
    let golden = Golden::load("gguf");
    let device = Default::default();
    let mut pipe = FluxPipeline::<B>::from_dir(
        &model_dir("tiny-flux-schnell"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let req = schnell_request(&golden, &device);
    for kind in TYPES {
        pipe.transformer = load(&format!("flux-{kind}.gguf"));
        let out = pipe
            .generate_with(&req, &mut TorchCpuGenerator::new(0), |_| {})
            .unwrap();
        let image = out.images.unwrap().to_rgb8(0).unwrap();
        common::assert_png_close(&image, &format!("gguf-flux-{kind}.png"), 2);
    }
}

#[test]
fn a_gguf_that_does_not_fit_the_config_names_the_tensor() {
    // The tiny-flux-schnell transformer's config (inner dim 32) against the file's (256).
    let dir = gguf_dir();
    let err = FluxTransformer2DModel::<B>::from_gguf_in(
        &dir.join("flux-Q8_0.gguf"),
        &model_dir("tiny-flux-schnell").join("transformer"),
        FloatDType::F32,
        &Default::default(),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("flux-Q8_0.gguf") && err.contains("has shape"),
        "{err}"
    );
}

#[test]
fn a_lora_on_quantized_weights_is_refused_and_nothing_changes() {
    let mut pipe = FluxPipeline::<B>::from_dir(
        &model_dir("tiny-flux-schnell"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    pipe.transformer = load("flux-Q8_0.gguf");
    let err = pipe
        .load_lora(fixtures().join("lora/tiny-flux-peft.safetensors"), 1.0)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("quantized GGUF blocks") && err.contains("tiny-flux-peft"),
        "{err}"
    );
    assert!(!pipe.transformer.transformer_blocks[0]
        .attn
        .to_q
        .weight
        .is_initialized());
}

/// schnell's run of `tools/golden/make_tiny_flux.py`'s settings from `gguf.json`, on `device`.
fn schnell_request<Bk: burn::tensor::backend::Backend>(
    golden: &Golden,
    device: &Bk::Device,
) -> FluxRequest<Bk> {
    let s = &golden.json["schnell"];
    let int = |k: &str| s[k].as_u64().unwrap() as usize;
    FluxRequest {
        common: GenerateRequest {
            prompts: vec![s["prompt"].as_str().unwrap().into()],
            num_inference_steps: int("num_inference_steps"),
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(int("width")),
            height: Some(int("height")),
            latents: Some(Tensor::from_data(
                golden.tensor::<4>("schnell.initial_latents").into_data(),
                device,
            )),
            ..Default::default()
        },
        max_sequence_length: int("max_sequence_length"),
        ..Default::default()
    }
}

/// On XLA's CPU plugin, compiled: the quantized weights go to the device as integers with
/// their scales (never as dense weights), the program dequantizes them, and the image is still
/// diffusers' within 2 levels, for every type; a transformer loaded on the host and moved
/// keeps its dense weights unmade too.
#[test]
fn schnell_with_a_quantized_transformer_compiled_on_xla_cpu_matches_diffusers() {
    use oxidiff::{Oxi, OxiDevice, ToDevice};
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let golden = Golden::load("gguf");
    let dir = gguf_dir();
    let transformer = |kind: &str, on: &OxiDevice| {
        FluxTransformer2DModel::<Oxi>::from_gguf_in(
            &dir.join(format!("flux-{kind}.gguf")),
            &dir.join("transformer"),
            FloatDType::F32,
            on,
        )
        .unwrap()
    };
    let host = OxiDevice::Cpu;
    let schnell = model_dir("tiny-flux-schnell");
    let generate = |pipe: &mut FluxPipeline<Oxi>, kind: &str| {
        let out = pipe
            .generate_with(
                &schnell_request(&golden, &device),
                &mut TorchCpuGenerator::new(0),
                |_| {},
            )
            .unwrap();
        let image = out.images.unwrap().to_rgb8(0).unwrap();
        common::assert_png_close(&image, &format!("gguf-flux-{kind}.png"), 2);
    };
    // Loaded on the device.
    let mut pipe =
        FluxPipeline::<Oxi>::from_dir(&schnell, &LoadOptions::default(), &device).unwrap();
    for kind in ["Q8_0", "Q4_0"] {
        pipe.transformer = transformer(kind, &device);
        pipe.compile().unwrap();
        generate(&mut pipe, kind);
    }
    // Loaded on the host, then moved.
    let mut pipe = FluxPipeline::<Oxi>::from_dir(&schnell, &LoadOptions::default(), &host).unwrap();
    pipe.transformer = transformer("Q4_K", &host);
    let mut pipe = pipe.to(&device);
    pipe.compile().unwrap();
    generate(&mut pipe, "Q4_K");
    assert_eq!(pipe.compile_stats().map(|s| s.programs), Some(1));
    // What the device holds: i8 values and f32 scales and offsets for every quantized weight,
    // no dense form of any.
    let to_q = &pipe.transformer.transformer_blocks[0].attn.to_q;
    assert!(
        !to_q.weight.is_initialized(),
        "the dense weight was never made"
    );
    let blocks = to_q.blocks.as_ref().expect("integer blocks");
    assert!(blocks.offsets.is_some(), "Q4_K has minima");
    assert_eq!(blocks.values.val().dtype(), burn::tensor::DType::I8);
    let memory = pipe
        .memory(&|d: &OxiDevice| d.to_string())
        .into_iter()
        .find(|c| c.component == "transformer")
        .unwrap()
        .memory;
    eprintln!("Q4_K transformer on {device}: {memory:?}");
    let quantized = memory.by_type["Q4_K"];
    let values = memory.by_type["i8"];
    assert_eq!(values * 144, quantized * 256, "one i8 per quantized value");
    assert_eq!(memory.by_place["xla:cpu:0"], memory.total() - quantized);
}

#[test]
fn quantized_sd3_transformer_calls_match_diffusers_gguf() {
    let golden = Golden::load("gguf");
    let dir = fixtures().join("tiny-sd3-gguf");
    for kind in TYPES {
        let model = SD3Transformer2DModel::<B>::from_gguf_in(
            &dir.join(format!("sd3-{kind}.gguf")),
            &dir.join("transformer"),
            FloatDType::F32,
            &Default::default(),
        )
        .unwrap();
        let out = model
            .forward(
                golden.tensor("sd3.input.hidden_states"),
                golden.tensor("sd3.input.timestep"),
                golden.tensor("sd3.input.encoder_hidden_states"),
                golden.tensor("sd3.input.pooled_projections"),
            )
            .unwrap();
        assert_close(&golden, &format!("sd3.{kind}.out_f32"), out.clone(), TOL);
        assert_close(&golden, &format!("sd3.{kind}.out"), out, TOL_DIFFUSERS);
    }
}

/// `memory()` reports a GGUF transformer by what it holds: its quantized weights in their
/// blocks, on the host, by quant type (one GGML block holds 32 values in 34 bytes for Q8_0, 18
/// for Q4_0, and 256 values in 144 bytes for Q4_K), beside its plain weights in f32; the
/// folder's transformer holds f32 only.
#[test]
fn memory_reports_quantized_blocks_by_type() {
    use burn::module::{Module, ModuleVisitor, Param};
    /// Values of the quantized weights' lazy dense forms (the plain weights the file stores in
    /// f16 are lazy too: converted into f32 at their first use).
    struct Lazy(usize);
    impl ModuleVisitor<B> for Lazy {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !param.is_initialized() && oxidiff::models::nn::is_quantized_dense(param.id) {
                self.0 += param.lazy_shape().num_elements();
            }
        }
    }
    let device = Default::default();
    let mut pipe = FluxPipeline::<B>::from_dir(
        &model_dir("tiny-flux-schnell"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    let host = |_: &_| "host".to_string();
    let transformer = |pipe: &FluxPipeline<B>| {
        pipe.memory(&host)
            .into_iter()
            .find(|c| c.component == "transformer")
            .unwrap()
            .memory
    };
    let plain = transformer(&pipe);
    assert_eq!(plain.by_type.keys().collect::<Vec<_>>(), ["f32"]);
    for (kind, values, bytes) in [("Q8_0", 32, 34), ("Q4_0", 32, 18), ("Q4_K", 256, 144)] {
        pipe.transformer = load(&format!("flux-{kind}.gguf"));
        let mut lazy = Lazy(0);
        pipe.transformer.visit(&mut lazy);
        assert!(
            pipe.transformer.transformer_blocks[0]
                .attn
                .to_q
                .blocks
                .is_none(),
            "burn-flex reads the blocks"
        );
        let memory = transformer(&pipe);
        eprintln!("{kind}: {memory:?}, {} quantized values", lazy.0);
        assert!(lazy.0 > 0);
        assert_eq!(memory.by_type.get(kind), Some(&(lazy.0 / values * bytes)));
        assert_eq!(memory.by_type.len(), 2, "{kind} blocks and f32: {memory:?}");
        assert_eq!(memory.by_place.get("host"), Some(&memory.total()));
    }
}

/// The tiny-sd3 run of `tools/golden/make_tiny_sd3.py`'s settings from `gguf.json`, on `device`.
fn sd3_request<Bk: burn::tensor::backend::Backend>(
    golden: &Golden,
    device: &Bk::Device,
) -> oxidiff::pipelines::Sd3Request<Bk> {
    let s = &golden.json["sd3"];
    let int = |k: &str| s[k].as_u64().unwrap() as usize;
    oxidiff::pipelines::Sd3Request {
        common: GenerateRequest {
            prompts: vec![s["prompt"].as_str().unwrap().into()],
            negative_prompts: vec![s["negative_prompt"].as_str().unwrap().into()],
            num_inference_steps: int("num_inference_steps"),
            guidance_scale: s["guidance_scale"].as_f64().unwrap(),
            width: Some(int("width")),
            height: Some(int("height")),
            latents: Some(Tensor::from_data(
                golden.tensor::<4>("sd3.initial_latents").into_data(),
                device,
            )),
            ..Default::default()
        },
        max_sequence_length: int("max_sequence_length"),
        ..Default::default()
    }
}

/// The tiny SD3 pipeline with each quantized transformer (tiny-sd3's text sizes, inner dim
/// 256) writes diffusers' image within 2 levels: on the CPU with the weights in their blocks,
/// and on XLA's CPU plugin, compiled, with the weights on the device as integers and scales.
#[test]
fn sd3_with_a_quantized_transformer_matches_diffusers_images_on_cpu_and_compiled() {
    use oxidiff::pipelines::StableDiffusion3Pipeline;
    use oxidiff::{Oxi, OxiDevice};
    let golden = Golden::load("gguf");
    let dir = fixtures().join("tiny-sd3-gguf");
    let file = |kind: &str| dir.join(format!("sd3-{kind}.gguf"));
    let config = dir.join("transformer");
    let mut pipe = StableDiffusion3Pipeline::<B>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &Default::default(),
    )
    .unwrap();
    for kind in TYPES {
        pipe.transformer = SD3Transformer2DModel::<B>::from_gguf_in(
            &file(kind),
            &config,
            FloatDType::F32,
            &Default::default(),
        )
        .unwrap();
        let out = pipe
            .generate_with(
                &sd3_request(&golden, &Default::default()),
                &mut TorchCpuGenerator::new(0),
                |_| {},
            )
            .unwrap();
        let image = out.images.unwrap().to_rgb8(0).unwrap();
        common::assert_png_close(&image, &format!("gguf-sd3-{kind}.png"), 2);
    }
    if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") {
        return;
    }
    let device: OxiDevice = "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"));
    let mut pipe = StableDiffusion3Pipeline::<Oxi>::from_dir(
        &model_dir("tiny-sd3"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    for kind in TYPES {
        pipe.transformer = SD3Transformer2DModel::<Oxi>::from_gguf_in(
            &file(kind),
            &config,
            FloatDType::F32,
            &device,
        )
        .unwrap();
        pipe.compile().unwrap();
        let out = pipe
            .generate_with(
                &sd3_request(&golden, &device),
                &mut TorchCpuGenerator::new(0),
                |_| {},
            )
            .unwrap();
        let image = out.images.unwrap().to_rgb8(0).unwrap();
        common::assert_png_close(&image, &format!("gguf-sd3-{kind}.png"), 2);
    }
}
