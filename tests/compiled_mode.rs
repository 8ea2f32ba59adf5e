//! Compiled mode of the tiny SD pipeline on XLA's CPU plugin: the denoising step (UNet and
//! classifier-free guidance, guidance scale a runtime input) is one XLA program; it matches
//! eager mode and the CPU backend, is not recompiled for new prompts, seeds, guidance scales,
//! schedulers or step counts, compiles once per new resolution, and a second process loads it
//! from the on-disk cache (a damaged cache entry is rebuilt); the compiled pipeline's 4-step
//! DDIM run matches diffusers' (`tools/golden/make_tiny_sd.py`) within 1e-4.
//!
//! Tolerances: compiled vs eager on the same plugin 1e-5 relative (the same f32 ops, fused and
//! reordered by XLA in one program; observed about 1e-7); against the CPU backend 1e-4
//! (burn-flex orders reductions differently, as in `pipeline_pjrt.rs`).

mod common;

use std::hash::{Hash, Hasher};
use std::path::Path;
use std::process::Command;

use burn::tensor::{Tensor, TensorData};
use common::{model_dir, relative_error, to_vec, Golden};
use oxidiff::pipelines::{GenerateRequest, LoadOptions, OutputType, StableDiffusionPipeline};
use oxidiff::schedulers::NoNoise;
use oxidiff::{Oxi, OxiDevice, ToDevice};

fn skip() -> bool {
    std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1")
}

fn xla() -> OxiDevice {
    "xla:cpu:0"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"))
}

/// The plugin's second device, which no other test of this binary uses: its client's upload
/// counters (process-wide per device) count this test's uploads alone while the others run.
fn xla_alone() -> OxiDevice {
    "xla:cpu:1"
        .parse()
        .unwrap_or_else(|e| panic!("{e}\nfetch the XLA CPU plugin first: tools/fetch-plugins.sh"))
}

fn load(scheduler: &str) -> StableDiffusionPipeline<Oxi> {
    let options = LoadOptions {
        scheduler: Some(scheduler.into()),
        ..Default::default()
    };
    StableDiffusionPipeline::<Oxi>::from_dir(&model_dir("tiny-sd1"), &options, &OxiDevice::Cpu)
        .unwrap_or_else(|e| panic!("{e}"))
}

/// The golden initial latents, two DDIM steps.
fn request(golden: &Golden, guidance_scale: f64) -> GenerateRequest<Oxi> {
    let (values, shape) = golden.host("pipe.latents");
    let shape: [usize; 4] = shape.try_into().unwrap();
    GenerateRequest {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 2,
        guidance_scale,
        latents: Some(Tensor::from_data(
            TensorData::new(values, shape),
            &OxiDevice::Cpu,
        )),
        ..Default::default()
    }
}

/// Final latents and image of one generation.
fn run(
    pipe: &mut StableDiffusionPipeline<Oxi>,
    req: &GenerateRequest<Oxi>,
) -> (Vec<f32>, Vec<f32>) {
    let out = pipe
        .generate_with(req, &mut NoNoise, |_| {})
        .unwrap_or_else(|e| panic!("{e}"));
    let image = out.images.expect("images").data;
    (to_vec(out.latents.to_device(&OxiDevice::Cpu)), image)
}

fn assert_within(what: &str, actual: &[f32], expected: &[f32], tol: f32) {
    let err = relative_error(actual, expected);
    eprintln!("{what}: relative error {err:e}");
    assert!(err <= tol, "{what}: relative error {err:e} exceeds {tol:e}");
}

#[test]
fn compiled_guided_step_matches_eager_xla_and_the_cpu_backend() {
    if skip() {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    let mut pipe = load("ddim");
    let cpu = run(&mut pipe, &request(&golden, 7.5));
    let mut pipe = pipe.to(&xla_alone());
    let eager = run(&mut pipe, &request(&golden, 7.5));
    let eager_low = run(&mut pipe, &request(&golden, 3.0));
    let eager_plain = run(&mut pipe, &request(&golden, 1.0));

    pipe.compile().unwrap();
    let compiled = run(&mut pipe, &request(&golden, 7.5));
    let log = pipe_log(&pipe);
    assert_eq!(log.programs, 1);
    assert_within("compiled vs eager xla latents", &compiled.0, &eager.0, 1e-5);
    assert_within("compiled vs eager xla image", &compiled.1, &eager.1, 1e-5);
    assert_within("compiled vs cpu latents", &compiled.0, &cpu.0, 1e-4);
    assert_within("compiled vs cpu image", &compiled.1, &cpu.1, 1e-4);

    // The guidance scale is a runtime input of the same program, not a frozen constant.
    let low = run(&mut pipe, &request(&golden, 3.0));
    assert_eq!(
        pipe_log(&pipe).programs,
        1,
        "a new guidance scale recompiled"
    );
    assert_within("guidance 3 compiled vs eager", &low.0, &eager_low.0, 1e-5);
    assert!(
        relative_error(&low.0, &compiled.0) > 1e-3,
        "guidance 3 and 7.5 gave the same latents: the scale was frozen at trace time"
    );

    // Without guidance the UNet sees the batch alone: another signature, another program.
    let plain = run(&mut pipe, &request(&golden, 1.0));
    assert_eq!(pipe_log(&pipe).programs, 2);
    assert_within(
        "no guidance compiled vs eager",
        &plain.0,
        &eager_plain.0,
        1e-5,
    );

    // diffusers itself: its 4-step DDIM run of the golden request, at the 1e-4 of the
    // one-device parity tests (tests/pipeline.rs); a new step count reuses the guided program.
    let mut full = request(&golden, 7.5);
    full.num_inference_steps = 4;
    let (latents, image) = run(&mut pipe, &full);
    assert_eq!(pipe_log(&pipe).programs, 2, "a new step count recompiled");
    let diffusers = |key: &str| golden.host(key).0;
    assert_within(
        "compiled vs diffusers latents",
        &latents,
        &diffusers("pipe.ddim.step3"),
        1e-4,
    );
    assert_within(
        "compiled vs diffusers image",
        &image,
        &diffusers("pipe.ddim.image"),
        1e-4,
    );

    // On XLA's CPU plugin the UNet's convolutions run in oxidiff's CPU kernel, which takes
    // their kernels in Burn's layout: nothing is given up, so eager mode uploads nothing again.
    assert!(
        oxidiff::backend::host_kernels::calls(oxidiff::backend::host_kernels::CONV2D_F32) > 0,
        "the compiled UNet's convolutions did not call the CPU kernel"
    );
    reuploads_after_compiled(&mut pipe, &golden, &eager.0, false);
    // XLA's own convolutions (as on TPU and GPU) take the kernels permuted: checked in a child
    // process, where `OXIDIFF_HOST_KERNELS=0` holds for every program.
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            PERMUTED_CHILD,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env(oxidiff::backend::compiled::HOST_KERNELS_ENV, "0")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("CHILD permuted ok"),
        "the child with XLA's convolutions failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const PERMUTED_CHILD: &str = "permuted_kernels_child";

/// Runs in a child process with `OXIDIFF_HOST_KERNELS=0` (see
/// `compiled_guided_step_matches_eager_xla_and_the_cpu_backend`): the compiled UNet takes its
/// convolution kernels permuted, and eager mode uploads them again once.
#[test]
#[ignore = "run by compiled_guided_step_matches_eager_xla_and_the_cpu_backend"]
fn permuted_kernels_child() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "a helper of another test; run that one instead"
    );
    let golden = Golden::load("tiny-sd1");
    let mut pipe = load("ddim").to(&xla_alone());
    let eager = run(&mut pipe, &request(&golden, 7.5));
    pipe.compile().unwrap();
    let compiled = run(&mut pipe, &request(&golden, 7.5));
    assert_within(
        "compiled (XLA's convolutions) vs eager",
        &compiled.0,
        &eager.0,
        1e-5,
    );
    reuploads_after_compiled(&mut pipe, &golden, &eager.0, true);
    println!("CHILD permuted ok");
}

/// Runs `pipe` compiled, then eager twice, counting the bytes each run uploads to its device,
/// and checks the second eager run gives `eager` (1e-5: the text encoder and VAE stay
/// compiled). With `permuted` kernels (XLA's convolutions), the programs took the UNet's
/// kernels permuted, uploaded from the mapped checkpoint in place of their device copies in
/// Burn's layout: back in eager mode those are uploaded again on first use, once. Without,
/// nothing was given up and nothing is uploaded again.
fn reuploads_after_compiled(
    pipe: &mut StableDiffusionPipeline<Oxi>,
    golden: &Golden,
    eager: &[f32],
    permuted: bool,
) {
    let client = oxidiff::backend::pjrt_client(&xla_alone()).expect("the xla:cpu:1 client");
    let uploaded_by = |pipe: &mut StableDiffusionPipeline<Oxi>| {
        let before = client.stats().uploaded_bytes;
        let out = run(pipe, &request(golden, 7.5));
        (out, client.stats().uploaded_bytes - before)
    };
    let (_, compiled_uploads) = uploaded_by(pipe);
    pipe.compiled = None;
    let (eager_again, first_eager_uploads) = uploaded_by(pipe);
    let (_, second_eager_uploads) = uploaded_by(pipe);
    eprintln!(
        "bytes uploaded per run: compiled {compiled_uploads}, eager again {first_eager_uploads}, \
         then {second_eager_uploads}"
    );
    if permuted {
        assert!(
            first_eager_uploads > compiled_uploads + 100_000,
            "the kernels given up for their permuted copies were not uploaded again"
        );
        assert!(
            second_eager_uploads < first_eager_uploads,
            "the kernels were uploaded again on every run"
        );
    } else {
        assert!(
            first_eager_uploads <= second_eager_uploads,
            "eager mode uploaded weights again, though no program took them permuted"
        );
    }
    assert_within(
        "eager after compiled vs eager xla latents",
        &eager_again.0,
        eager,
        1e-5,
    );
}

/// The compiled text encoder and VAE (`compile` builds them with the UNet's program): CLIP's
/// layers match its ops (every layer's output), the VAE's encoder and decoder match the VAE's
/// own ops on the same plugin, whole, sliced and tiled (one program per tile shape, the tiling
/// and blending stay the model's), and each is counted per component.
#[test]
fn compiled_text_encoder_and_vae_match_their_ops_whole_sliced_and_tiled() {
    if skip() {
        return;
    }
    let mut pipe = load("ddim").to(&xla());
    let device = xla();
    let latents = |n: usize, side: usize| {
        let values: Vec<f32> = (0..n * 4 * side * side)
            .map(|i| ((i * 7919 % 997) as f32 / 997.0 - 0.5) * 3.0)
            .collect();
        Tensor::<Oxi, 4>::from_data(TensorData::new(values, [n, 4, side, side]), &device)
    };
    let image = Tensor::<Oxi, 4>::from_data(
        TensorData::new(
            (0..3 * 64 * 64)
                .map(|i| ((i * 31 % 255) as f32 / 127.5) - 1.0)
                .collect::<Vec<f32>>(),
            [1, 3, 64, 64],
        ),
        &device,
    );
    let tiling = oxidiff::models::vae_tiling::VaeTiling::new(32, 8).unwrap();
    let vae = |pipe: &StableDiffusionPipeline<Oxi>| pipe.vae.clone();
    let run_all = |vae: &mut oxidiff::models::AutoencoderKL<Oxi>| {
        vae.disable_tiling();
        vae.disable_slicing();
        let whole = to_vec(vae.decode(latents(2, 8)));
        let moments = to_vec(vae.encode(image.clone()).mean);
        vae.enable_slicing();
        let sliced = to_vec(vae.decode(latents(2, 8)));
        vae.disable_slicing();
        vae.enable_tiling(tiling);
        let tiled = to_vec(vae.decode(latents(1, 10)));
        let tiled_encode = to_vec(vae.encode(image.clone()).mean);
        vae.disable_tiling();
        [whole, moments, sliced, tiled, tiled_encode]
    };
    let eager = run_all(&mut vae(&pipe));
    assert!(pipe.component_stats().is_empty(), "eager: no programs");
    // CLIP's layers: two prompts of 77 tokens, with every layer's output.
    let ids: Vec<Vec<u32>> = (0..2u32)
        .map(|row| {
            (0..77)
                .map(|i| if i == 76 { 49407 } else { 320 + row * 7 + i })
                .collect()
        })
        .collect();
    let encode = |encoder: &oxidiff::models::ClipTextModel<Oxi>| {
        let out = encoder.forward(&ids, true).unwrap();
        let mut all = vec![to_vec(out.last_hidden_state), to_vec(out.pooler_output)];
        all.extend(out.hidden_states.into_iter().map(to_vec));
        all
    };
    let eager_text = encode(&pipe.text_encoder);

    pipe.compile().unwrap();
    let compiled_text = encode(&pipe.text_encoder);
    assert_eq!(compiled_text.len(), eager_text.len());
    for (i, (compiled, eager)) in compiled_text.iter().zip(&eager_text).enumerate() {
        assert_within(
            &format!("compiled vs eager CLIP output {i}"),
            compiled,
            eager,
            1e-5,
        );
    }
    let compiled = run_all(&mut pipe.vae);
    let names = [
        "decode",
        "encode",
        "sliced decode",
        "tiled decode",
        "tiled encode",
    ];
    for ((name, compiled), eager) in names.iter().zip(&compiled).zip(&eager) {
        assert_within(
            &format!("compiled vs eager VAE {name}"),
            compiled,
            eager,
            1e-5,
        );
    }
    let programs = |component: &str| {
        pipe.component_stats()
            .into_iter()
            .find(|c| c.component == component)
            .unwrap_or_else(|| panic!("no {component} in {:?}", pipe.component_stats()))
            .stats
            .programs
    };
    // Decoder: [2,4,8,8], [1,4,8,8] (a slice), and the tiles of a 10x10 latent with 4-latent
    // tiles, stride 3 (diffusers' overlap 0.25): [1,4,4,4], [1,4,4,1], [1,4,1,4], [1,4,1,1].
    assert_eq!(programs("vae_decoder"), 6, "{:?}", pipe.component_stats());
    // Encoder: the whole 64x64 image, then its 32-pixel tiles with stride 24: 32x32, 32x16,
    // 16x32, 16x16.
    assert_eq!(programs("vae_encoder"), 5, "{:?}", pipe.component_stats());
    assert_eq!(programs("text_encoder"), 1, "one token count");
    assert_eq!(programs("unet"), 0, "nothing generated yet");
    // Moving the pipeline drops every program (they hold the weights of their device).
    let pipe = pipe.to(&device);
    assert!(
        pipe.component_stats().is_empty(),
        "{:?}",
        pipe.component_stats()
    );
}

/// T5's blocks as one program (what PixArt, SD3 and Flux compile): with and without an
/// attention mask, equal to its ops within 1e-5; one program per token length and mask shape,
/// reused for new tokens; counted under its component name; dropped by `clear`.
#[test]
fn compiled_t5_matches_its_ops_with_and_without_a_mask() {
    use oxidiff::models::T5EncoderModel;
    use oxidiff::pipelines::compiled::{compile_t5, t5_compile_stats};
    if skip() {
        return;
    }
    let device = xla();
    let mut t5 = T5EncoderModel::<Oxi>::from_dir(
        &model_dir("tiny-pixart-alpha").join("text_encoder"),
        None,
        &device,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let ids = |offset: u32, seq: usize| -> Vec<Vec<u32>> {
        (0..2)
            .map(|b| {
                (0..seq as u32)
                    .map(|i| (i * 7 + b * 13 + offset) % 90 + 3)
                    .collect()
            })
            .collect()
    };
    let mask: Vec<Vec<u32>> = vec![vec![1; 12], [vec![1; 5], vec![0; 7]].concat()];
    let encode = |t5: &T5EncoderModel<Oxi>, ids: &[Vec<u32>], mask: Option<&[Vec<u32>]>| {
        to_vec(t5.forward(ids, mask).unwrap().to_device(&OxiDevice::Cpu))
    };
    type Case<'a> = (Vec<Vec<u32>>, Option<&'a [Vec<u32>]>);
    let cases: Vec<Case> = vec![
        (ids(0, 12), Some(&mask)),
        (ids(5, 12), Some(&mask)),
        (ids(0, 12), None),
        (ids(1, 9), None),
    ];
    let expected: Vec<Vec<f32>> = cases
        .iter()
        .map(|(ids, mask)| encode(&t5, ids, *mask))
        .collect();
    compile_t5(&mut t5, "text_encoder");
    for ((ids, mask), expected) in cases.iter().zip(&expected) {
        let actual = encode(&t5, ids, *mask);
        assert_within("t5", &actual, expected, 1e-5);
    }
    let stats = t5_compile_stats(&t5, "text_encoder").expect("a program");
    // 12 tokens (the mask makes no new signature: the bias is an input either way), 9 tokens.
    assert_eq!(stats.stats.programs, 2, "{stats:?}");
    t5.blocks_program.clear();
    assert!(t5_compile_stats(&t5, "text_encoder").is_none());
}

fn pipe_log(pipe: &StableDiffusionPipeline<Oxi>) -> oxidiff::pipelines::CompileStats {
    pipe.compile_stats().expect("compiled mode")
}

/// The "done when": 10 steps, two prompts, two seeds, two guidance scales and two
/// schedulers on one program; exactly one more for a new resolution.
#[test]
fn no_recompiles_across_prompts_seeds_guidance_schedulers_and_one_per_resolution() {
    if skip() {
        return;
    }
    let device = xla();
    // Text encoder on the CPU (its eager ops are not what this test is about); UNet and VAE
    // on the XLA device.
    let mut pipe = load("ddim").to_components(&OxiDevice::Cpu, &device, &device);
    pipe.compile().unwrap();
    let mut seen = Vec::new();
    for scheduler in ["ddim", "euler_a"] {
        pipe.set_scheduler(scheduler).unwrap();
        for prompt in [
            "a photo of an astronaut riding a horse",
            "a red apple on a table",
        ] {
            for seed in [1, 2] {
                for guidance_scale in [7.5, 3.0] {
                    let mut steps = 0;
                    let out = pipe
                        .generate_with(
                            &GenerateRequest {
                                prompts: vec![prompt.into()],
                                num_inference_steps: 10,
                                guidance_scale,
                                seed,
                                output: OutputType::Latents,
                                ..Default::default()
                            },
                            &mut oxidiff::schedulers::TorchCpuGenerator::new(seed),
                            |_| steps += 1,
                        )
                        .unwrap_or_else(|e| panic!("{e}"));
                    assert_eq!(steps, 10);
                    let stats = pipe_log(&pipe);
                    assert_eq!(
                        stats.programs, 1,
                        "recompiled for {scheduler}, {prompt:?}, seed {seed}, guidance {guidance_scale}"
                    );
                    seen.push(to_vec(out.latents.to_device(&OxiDevice::Cpu)));
                }
            }
        }
    }
    assert_eq!(seen.len(), 16);
    // Every combination gave its own result: the program's inputs are live, not frozen.
    for (i, a) in seen.iter().enumerate() {
        for b in &seen[..i] {
            assert!(
                relative_error(a, b) > 1e-4,
                "two combinations gave the same latents"
            );
        }
    }
    let stats = pipe_log(&pipe);
    assert_eq!(stats.programs, 1, "{stats:?}");

    let out = pipe
        .generate(&GenerateRequest {
            prompts: vec!["a red apple on a table".into()],
            num_inference_steps: 2,
            width: Some(72),
            height: Some(56),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(out.images.unwrap().width, 72);
    assert_eq!(
        pipe_log(&pipe).programs,
        2,
        "a new resolution compiles exactly once"
    );
    pipe.generate(&GenerateRequest {
        prompts: vec!["again".into()],
        num_inference_steps: 3,
        width: Some(72),
        height: Some(56),
        output: OutputType::Latents,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(pipe_log(&pipe).programs, 2);
}

/// Compiled mode's scheduler step, one fused program per step structure: for schedulers with
/// history (DPM++ 2M, UniPC, DEIS, LMS, PNDM, DPM++ singlestep), noise (Euler a) and two
/// stages (Heun, DPM2) the latents equal the same scheduler's ops run one by one on the same
/// plugin, no step falls back to ops, and a new step count compiles no scheduler program.
#[test]
fn compiled_scheduler_steps_match_their_ops_and_a_new_step_count_compiles_nothing() {
    if skip() {
        return;
    }
    let golden = Golden::load("tiny-sd1");
    let mut pipe = load("ddim").to(&xla());
    pipe.compile().unwrap();
    let generate = |pipe: &mut StableDiffusionPipeline<Oxi>, name: &str, steps: usize| {
        let mut req = request(&golden, 7.5);
        req.num_inference_steps = steps;
        req.output = OutputType::Latents;
        let mut noise = oxidiff::schedulers::TorchCpuGenerator::new(7);
        let out = pipe
            .generate_with(&req, &mut noise, |_| {})
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        to_vec(out.latents.to_device(&OxiDevice::Cpu))
    };
    let program = |pipe: &StableDiffusionPipeline<Oxi>| {
        pipe.scheduler_program
            .as_ref()
            .expect("compile() builds the scheduler program")
            .compile_stats()
    };
    for name in [
        "dpm++_2m",
        "unipc",
        "deis",
        "lms",
        "pndm",
        "dpm++_sde",
        "euler_a",
        "heun",
        "dpm2",
    ] {
        pipe.set_scheduler(name).unwrap();
        let fused = generate(&mut pipe, name, 5);
        let built = program(&pipe);
        let fused_more = generate(&mut pipe, name, 7);
        assert_eq!(
            program(&pipe),
            built,
            "{name}: a new step count compiled a scheduler program"
        );
        let kept = pipe.scheduler_program.take();
        let ops = generate(&mut pipe, name, 5);
        let ops_more = generate(&mut pipe, name, 7);
        pipe.scheduler_program = kept;
        eprintln!("{name}: {built:?}");
        assert_within(
            &format!("{name}, 5 steps: fused vs ops"),
            &fused,
            &ops,
            1e-5,
        );
        assert_within(
            &format!("{name}, 7 steps: fused vs ops"),
            &fused_more,
            &ops_more,
            1e-5,
        );
    }
    let scheduler = pipe.scheduler_program.as_ref().unwrap();
    assert_eq!(scheduler.eager_fallbacks(), 0);
    let stats = pipe.component_stats();
    assert!(
        stats
            .iter()
            .any(|c| c.component == "scheduler" && c.stats == scheduler.compile_stats()),
        "{stats:?}"
    );
}

const CHILD_ENV: &str = "OXIDIFF_COMPILED_MODE_CHILD";
const CHILD_TEST: &str = "cache_child_generation";

/// Runs in a child process (see `a_second_process_...`): one compiled generation, then its
/// counts and a hash of the latents on one line.
#[test]
#[ignore = "run by a_second_process_loads_from_the_disk_cache_and_a_damaged_entry_is_rebuilt"]
fn cache_child_generation() {
    assert!(
        std::env::var_os(CHILD_ENV).is_some(),
        "a helper of another test; run that one instead"
    );
    let device = xla();
    let mut pipe = load("ddim").to_components(&OxiDevice::Cpu, &device, &device);
    pipe.compile().unwrap();
    let out = pipe
        .generate(&GenerateRequest {
            prompts: vec!["a photo of an astronaut riding a horse".into()],
            num_inference_steps: 2,
            seed: 5,
            output: OutputType::Latents,
            ..Default::default()
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for v in to_vec(out.latents.to_device(&OxiDevice::Cpu)) {
        v.to_bits().hash(&mut hasher);
    }
    // Every program of the process: the UNet's (with its kernel transposes) and the scheduler
    // step's.
    let stats = pipe
        .component_stats()
        .iter()
        .fold(oxidiff::pipelines::CompileStats::default(), |sum, c| {
            sum + c.stats
        });
    // UNet programs loaded by `compile()`, ahead of the first step (warm start).
    let warm = pipe.compiled.as_ref().map_or(0, |c| {
        c.compile_log().iter().filter(|i| i.warm_start).count()
    });
    println!(
        "CHILD programs={} xla_compiles={} disk_loads={} process_compiles={} warm={warm} latents={:016x}",
        pipe_log(&pipe).programs,
        stats.xla_compiles,
        stats.disk_loads,
        oxidiff::backend::compiled::compile_count(),
        hasher.finish()
    );
}

/// `(xla_compiles, disk_loads, process_compiles, latents hash)` of a child run, and whether
/// its UNet program was loaded at warm start.
fn child(cache: &Path) -> (u64, u64, u64, String, bool) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            CHILD_TEST,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
        .env("OXIDIFF_COMPILE_CACHE", cache)
        .env("OXIDIFF_LOG_COMPILES", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    eprintln!(
        "child: {}",
        stderr
            .lines()
            .filter(|l| l.contains("oxidiff:"))
            .collect::<Vec<_>>()
            .join("\n       ")
    );
    // libtest prints `test NAME ... ` before the captured line.
    let line = stdout
        .lines()
        .find_map(|l| l.find("CHILD ").map(|at| &l[at..]))
        .unwrap_or_else(|| panic!("no result line:\n{stdout}\n{stderr}"));
    let field = |name: &str| -> String {
        line.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("{name} missing in {line}"))
            .to_string()
    };
    assert_eq!(field("programs"), "1", "{line}");
    let number = |name: &str| field(name).parse::<u64>().unwrap();
    (
        number("xla_compiles"),
        number("disk_loads"),
        number("process_compiles"),
        field("latents"),
        number("warm") == 1,
    )
}

fn cache_entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    entries.retain(|p| p.extension().is_some_and(|e| e == "pjrt"));
    entries
}

#[test]
fn a_second_process_loads_from_the_disk_cache_and_a_damaged_entry_is_rebuilt() {
    if skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");

    // The UNet's program and the kernel transposes it needs (one per kernel type and layout),
    // and the scheduler step's programs.
    let (compiled, loads, process, first, warm) = child(&cache);
    assert!(!warm, "nothing to warm-start from yet");
    assert!(compiled >= 1, "first process compiles");
    assert_eq!((loads, process), (0, compiled), "every compile counted");
    let mut entries = cache_entries(&cache);
    assert_eq!(entries.len() as u64, compiled, "{entries:?}");

    let (compiles, loads, process, second, warm) = child(&cache);
    assert_eq!(
        (compiles, loads, process),
        (0, compiled, 0),
        "a second process loads every executable instead of compiling"
    );
    assert!(
        warm,
        "the second process loads the UNet's program in `compile()`"
    );
    assert_eq!(
        second, first,
        "the loaded executable gives the same latents, bit for bit"
    );

    // A flipped byte in the middle of the program's executable (the largest entry): detected
    // by the checksum, rebuilt.
    entries.sort_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0));
    let entry = entries.last().unwrap();
    let mut bytes = std::fs::read(entry).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x5a;
    std::fs::write(entry, &bytes).unwrap();
    let (compiles, loads, _, third, warm) = child(&cache);
    assert!(!warm, "a damaged entry is not warm-started");
    assert_eq!(
        (compiles, loads),
        (1, compiled - 1),
        "a corrupt entry is recompiled"
    );
    assert_eq!(third, first);

    // A truncated entry (a crash while another process wrote it): rebuilt too.
    let bytes = std::fs::read(entry).unwrap();
    std::fs::write(entry, &bytes[..bytes.len() / 3]).unwrap();
    let (compiles, loads, _, fourth, _) = child(&cache);
    assert_eq!(
        (compiles, loads),
        (1, compiled - 1),
        "a truncated entry is recompiled"
    );
    assert_eq!(fourth, first);

    // The rebuilt entry is whole again.
    let (compiles, loads, _, fifth, warm) = child(&cache);
    assert!(warm);
    assert_eq!((compiles, loads), (0, compiled));
    assert_eq!(fifth, first);
    assert_eq!(cache_entries(&cache).len() as u64, compiled);
}

/// The ControlNet pipelines compiled on XLA's CPU plugin (ControlNets, UNet and guidance as one
/// program) against diffusers' PNGs (tools/golden/make_controlnet.py and
/// make_controlnet_sdxl.py), within 2 levels as their eager runs: SD with two ControlNets and
/// guidance windows (one program for every step, windows and scales as inputs), guess mode,
/// image to image and inpainting; SDXL with its added condition, plain and in guess mode.
#[test]
fn compiled_controlnet_steps_match_diffusers_for_sd_and_sdxl() {
    use common::assert_png_close;
    use oxidiff::pipelines::{
        Control, ControlRequest, InpaintOptions, StableDiffusionControlNetImg2ImgPipeline,
        StableDiffusionControlNetInpaintPipeline, StableDiffusionControlNetPipeline,
        StableDiffusionXLControlNetPipeline, XlRequest,
    };
    if skip() {
        return;
    }
    let device = xla();
    let image = image::open(common::fixtures().join("golden/controlnet-input.png")).unwrap();
    let request = || GenerateRequest::<Oxi> {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 7.5,
        seed: 42,
        ..Default::default()
    };
    let png =
        |out: oxidiff::pipelines::PipelineOutput<Oxi>| out.images.unwrap().to_rgb8(0).unwrap();
    let windowed = |scale, guidance_start, guidance_end| Control {
        scale,
        guidance_start,
        guidance_end,
        ..Control::new(image.clone())
    };
    let nets = [
        model_dir("tiny-controlnet-sd1"),
        model_dir("tiny-controlnet-sd1-b"),
    ];
    let load = |n: usize| {
        let refs: Vec<&Path> = nets[..n].iter().map(|d| d.as_path()).collect();
        let mut pipe = StableDiffusionControlNetPipeline::<Oxi>::from_dir(
            &model_dir("tiny-sd1"),
            &refs,
            &LoadOptions::default(),
            &device,
        )
        .unwrap();
        pipe.compile().unwrap();
        pipe
    };

    let mut two = load(2);
    let multi = ControlRequest {
        controls: vec![windowed(0.8, 0.0, 0.75), windowed(0.5, 0.25, 1.0)],
        guess_mode: false,
    };
    assert_png_close(
        &png(two.generate(&request(), &multi).unwrap()),
        "controlnet-sd1-multi.png",
        2,
    );
    let stats = two.compile_stats().unwrap();
    let programs = two.programs.as_ref().unwrap().compile_stats().programs;
    assert_eq!(
        programs, 1,
        "one program for every step and window: {stats:?}"
    );

    let mut one = load(1);
    let guess = ControlRequest {
        controls: vec![windowed(0.9, 0.0, 1.0)],
        guess_mode: true,
    };
    assert_png_close(
        &png(one.generate(&request(), &guess).unwrap()),
        "controlnet-sd1-guess.png",
        2,
    );
    let edit = ControlRequest {
        controls: vec![windowed(0.8, 0.0, 0.8)],
        guess_mode: false,
    };
    let golden = common::fixtures().join("golden");
    let init = image::open(golden.join("img2img-input.png")).unwrap();
    let mask = image::open(golden.join("inpaint-mask.png")).unwrap();
    let mut img2img = StableDiffusionControlNetImg2ImgPipeline::from(one);
    let out = img2img.generate(&request(), &init, 0.75, &edit).unwrap();
    assert_png_close(&png(out), "controlnet-sd1-img2img.png", 2);
    let mut inpaint = StableDiffusionControlNetInpaintPipeline::from(img2img.pipe);
    let options = InpaintOptions {
        strength: 0.75,
        padding_mask_crop: None,
    };
    let out = inpaint
        .generate(&request(), &init, &mask, &options, &edit)
        .unwrap();
    assert_png_close(&png(out), "controlnet-sd1-inpaint.png", 2);

    let xl_net = model_dir("tiny-controlnet-sdxl");
    let mut xl = StableDiffusionXLControlNetPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sdxl"),
        &[xl_net.as_path()],
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    xl.compile().unwrap();
    let xl_request = XlRequest::new(GenerateRequest {
        guidance_scale: 5.0,
        ..request()
    });
    let single = ControlRequest {
        controls: vec![Control::new(image.clone())],
        guess_mode: false,
    };
    assert_png_close(
        &png(xl.generate(&xl_request, &single).unwrap()),
        "controlnet-sdxl-single.png",
        2,
    );
    let guess = ControlRequest {
        controls: vec![windowed(0.9, 0.0, 1.0)],
        guess_mode: true,
    };
    assert_png_close(
        &png(xl.generate(&xl_request, &guess).unwrap()),
        "controlnet-sdxl-guess.png",
        2,
    );
    assert_eq!(xl.programs.as_ref().unwrap().compile_stats().programs, 2);
}

/// The SD3 and Flux ControlNet pipelines compiled on XLA's CPU plugin (ControlNets and
/// transformer as one program, scales and windows as inputs) against diffusers' PNGs
/// (tools/golden/make_controlnet_sd3.py, make_controlnet_flux.py), within 2 levels as their
/// eager runs: two ControlNets with guidance windows each, one program for every step.
#[test]
fn compiled_sd3_and_flux_controlnets_match_diffusers() {
    use common::assert_png_close;
    use oxidiff::pipelines::{
        Control, ControlRequest, FluxControlNetPipeline, FluxRequest, Sd3Request,
        StableDiffusion3ControlNetPipeline,
    };
    if skip() {
        return;
    }
    let device = xla();
    let image = image::open(common::fixtures().join("golden/controlnet-input.png")).unwrap();
    let windowed = |scale, guidance_start, guidance_end| Control {
        scale,
        guidance_start,
        guidance_end,
        ..Control::new(image.clone())
    };
    let png =
        |out: oxidiff::pipelines::PipelineOutput<Oxi>| out.images.unwrap().to_rgb8(0).unwrap();
    let prompt = "A photo of an astronaut riding a horse on the moon";

    let nets = [
        model_dir("tiny-controlnet-sd3"),
        model_dir("tiny-controlnet-sd3-b"),
    ];
    let refs: Vec<&Path> = nets.iter().map(|d| d.as_path()).collect();
    let mut sd3 = StableDiffusion3ControlNetPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sd3"),
        &refs,
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    sd3.compile().unwrap();
    let request = Sd3Request {
        common: GenerateRequest {
            prompts: vec![prompt.into()],
            negative_prompts: vec!["blurry, low quality".into()],
            num_inference_steps: 3,
            guidance_scale: 5.0,
            width: Some(48),
            height: Some(64),
            seed: 42,
            ..Default::default()
        },
        max_sequence_length: 24,
        ..Default::default()
    };
    let multi = ControlRequest {
        controls: vec![windowed(0.8, 0.0, 0.7), windowed(0.5, 0.3, 1.0)],
        guess_mode: false,
    };
    assert_png_close(
        &png(sd3.generate(&request, &multi).unwrap()),
        "controlnet-sd3-multi.png",
        2,
    );
    let stats = sd3.compile_stats().unwrap();
    assert!(stats.programs >= 1, "{stats:?}");

    let nets = [
        model_dir("tiny-controlnet-flux"),
        model_dir("tiny-controlnet-flux-b"),
    ];
    let refs: Vec<&Path> = nets.iter().map(|d| d.as_path()).collect();
    let mut flux = FluxControlNetPipeline::<Oxi>::from_dir(
        &model_dir("tiny-flux-dev"),
        &refs,
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    flux.compile().unwrap();
    let request = FluxRequest {
        common: GenerateRequest {
            prompts: vec![prompt.into()],
            num_inference_steps: 4,
            guidance_scale: 3.5,
            width: Some(96),
            height: Some(64),
            seed: 42,
            ..Default::default()
        },
        max_sequence_length: 24,
        ..Default::default()
    };
    let multi = ControlRequest {
        controls: vec![windowed(0.8, 0.0, 0.75), windowed(0.6, 0.25, 1.0)],
        guess_mode: false,
    };
    assert_png_close(
        &png(flux.generate(&request, &multi).unwrap()),
        "controlnet-flux-multi.png",
        2,
    );
    let stats = flux.compile_stats().unwrap();
    assert!(stats.programs >= 1, "{stats:?}");
}

/// Flux ControlNet-Union and XLabs ControlNets compiled on XLA's CPU plugin against
/// diffusers' PNGs (tools/golden/make_controlnet_flux_variants.py), within 2 levels as their
/// eager runs: the control mode is a runtime input (another mode reuses the program and
/// changes the image), one Union serves two images, XLabs' conditioning is embedded once.
#[test]
fn compiled_flux_union_and_xlabs_controlnets_match_diffusers() {
    use common::{assert_png_close, png_level_diff};
    use oxidiff::pipelines::{Control, ControlRequest, FluxControlNetPipeline, FluxRequest};
    if skip() {
        return;
    }
    let device = xla();
    let image = image::open(common::fixtures().join("golden/controlnet-input.png")).unwrap();
    let control = |image: &image::DynamicImage, scale, mode, window: (f64, f64)| Control {
        scale,
        control_mode: mode,
        guidance_start: window.0,
        guidance_end: window.1,
        ..Control::new(image.clone())
    };
    let request = |controls| ControlRequest {
        controls,
        guess_mode: false,
    };
    let png =
        |out: oxidiff::pipelines::PipelineOutput<Oxi>| out.images.unwrap().to_rgb8(0).unwrap();
    let flux = FluxRequest {
        common: GenerateRequest {
            prompts: vec!["A photo of an astronaut riding a horse on the moon".into()],
            num_inference_steps: 4,
            guidance_scale: 3.5,
            width: Some(96),
            height: Some(64),
            seed: 42,
            ..Default::default()
        },
        max_sequence_length: 24,
        ..Default::default()
    };
    let pipe = |net: &str| {
        let mut pipe = FluxControlNetPipeline::<Oxi>::from_dir(
            &model_dir("tiny-flux-dev"),
            &[model_dir(net).as_path()],
            &LoadOptions::default(),
            &device,
        )
        .unwrap();
        pipe.compile().unwrap();
        pipe
    };

    let mut union = pipe("tiny-controlnet-flux-union");
    let two = png(union
        .generate(
            &flux,
            &request(vec![control(&image, 0.9, Some(2), (0.0, 1.0))]),
        )
        .unwrap());
    assert_png_close(&two, "controlnet-flux-union.png", 2);
    let programs = union.compile_stats().unwrap().programs;
    let zero = png(union
        .generate(
            &flux,
            &request(vec![control(&image, 0.9, Some(0), (0.0, 1.0))]),
        )
        .unwrap());
    assert_eq!(union.compile_stats().unwrap().programs, programs);
    assert!(png_level_diff(&two, &zero) > 2);
    let multi = request(vec![
        control(&image, 0.8, Some(0), (0.0, 0.75)),
        control(&image.fliph(), 0.6, Some(3), (0.25, 1.0)),
    ]);
    assert_png_close(
        &png(union.generate(&flux, &multi).unwrap()),
        "controlnet-flux-union-multi.png",
        2,
    );

    let mut xlabs = pipe("tiny-controlnet-flux-xlabs");
    let one = request(vec![control(&image, 0.9, None, (0.0, 1.0))]);
    assert_png_close(
        &png(xlabs.generate(&flux, &one).unwrap()),
        "controlnet-flux-xlabs.png",
        2,
    );
}

/// IP-Adapter in compiled mode on XLA's CPU plugin: the UNet's image branches are part of the
/// compiled step (the image tokens ride at the end of the context input), within 2 levels of
/// diffusers' PNGs (tools/golden/make_ip_adapter.py) as the eager runs; changing the adapter
/// after compiling is refused (the program holds the UNet it was traced with), and so is
/// splitting it over devices.
#[test]
fn compiled_ip_adapter_steps_match_diffusers_for_sd_and_sdxl() {
    use common::assert_png_close;
    use oxidiff::pipelines::{PipelineError, StableDiffusionXLPipeline, XlRequest};
    if skip() {
        return;
    }
    let device = xla();
    let fixtures = common::fixtures();
    let image = image::open(fixtures.join("golden/ip-adapter-input.png")).unwrap();
    let request = GenerateRequest::<Oxi> {
        prompts: vec!["a photo of an astronaut riding a horse".into()],
        negative_prompts: vec!["blurry".into()],
        num_inference_steps: 4,
        guidance_scale: 7.5,
        seed: 42,
        ip_adapter_image: Some(image),
        ..Default::default()
    };
    let png =
        |out: oxidiff::pipelines::PipelineOutput<Oxi>| out.images.unwrap().to_rgb8(0).unwrap();
    let adapter = |name: &str| fixtures.join("ip-adapter").join(name);

    let mut sd = StableDiffusionPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sd1"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    sd.load_ip_adapter(&adapter("ip-adapter_sd1.safetensors"), None)
        .unwrap();
    sd.set_ip_adapter_scale(0.8).unwrap();
    sd.compile().unwrap();
    assert_png_close(
        &png(sd.generate(&request).unwrap()),
        "ip-adapter-sd1.png",
        2,
    );
    assert_eq!(sd.compile_stats().unwrap().programs, 1);
    let err = sd.set_ip_adapter_scale(0.5).unwrap_err();
    assert!(matches!(err, PipelineError::Compile(_)), "{err}");
    let err = sd
        .enable_parallelism(oxidiff::pipelines::parallel::TensorParallelConfig::new(2))
        .unwrap_err();
    assert!(
        err.to_string().contains("does not split over devices"),
        "{err}"
    );

    let mut xl = StableDiffusionXLPipeline::<Oxi>::from_dir(
        &model_dir("tiny-sdxl"),
        &LoadOptions::default(),
        &device,
    )
    .unwrap();
    xl.load_ip_adapter(&adapter("ip-adapter_sdxl.safetensors"), None)
        .unwrap();
    xl.set_ip_adapter_scale(0.8).unwrap();
    xl.compile().unwrap();
    let xl_request = XlRequest::new(GenerateRequest {
        guidance_scale: 5.0,
        ..request
    });
    assert_png_close(
        &png(xl.generate(&xl_request).unwrap()),
        "ip-adapter-sdxl.png",
        2,
    );
}

// --- the kernel hub (kernels/, tools/kernels/export_flash_attention.py) -----------------------

fn kernel_hub_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels")
}

/// softmax(q k^T * scale) v on the CPU backend, for `[batch, heads, seq, dim]` inputs.
fn plain_attention(q: &[f32], k: &[f32], v: &[f32], shape: [usize; 4], scale: f64) -> Vec<f32> {
    type Cpu = common::B;
    let device = Default::default();
    let t = |x: &[f32]| Tensor::<Cpu, 4>::from_data(TensorData::new(x.to_vec(), shape), &device);
    let scores = t(q).matmul(t(k).swap_dims(2, 3)).mul_scalar(scale);
    to_vec(burn::tensor::activation::softmax(scores, 3).matmul(t(v)))
}

/// JAX's Pallas TPU flash attention, exported in interpret mode (plain StableHLO from the same
/// source and parameters as the TPU artifact), runs on XLA's CPU plugin and gives the plain
/// attention: 1e-5 relative in f32 (blockwise online softmax against one softmax); in bf16
/// (inputs and output rounded to bf16, f32 accumulation in the kernel) 1e-2. Three buckets, one
/// for each way the export covers a shape: a sequence of 128-blocks; an odd sequence (144) as
/// one block; an odd sequence over one block's limit (1100, padded to 1152 with the padding
/// masked by segment ids) with a head dim over 128 (160, padded with zeros to 256).
#[test]
fn interpreted_flash_attention_kernel_matches_the_plain_attention_on_xla_cpu() {
    use oxidiff::backend::kernels::{KernelHub, KernelRequest, KernelTarget};
    use oxidiff::backend::pjrt::CompileOptions;
    use oxidiff::backend::platform::{shared_client, PjrtPlatform};
    if skip() {
        return;
    }
    let hub = KernelHub::open(&kernel_hub_dir());
    let client = shared_client(&PjrtPlatform::XlaCpu).unwrap_or_else(|e| panic!("{e}"));
    let device = client.device(0).unwrap();
    // Uniform in [-2, 2) from a 64-bit LCG (Knuth's constants).
    let mut state = 5u64;
    for shape in [[1usize, 2, 128, 64], [1, 2, 144, 64], [1, 2, 1100, 160]] {
        let n: usize = shape.iter().product();
        let mut random = || -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
                })
                .collect()
        };
        let (q, k, v) = (random(), random(), random());
        let dims: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        for (dtype, tolerance) in [("float32", 1e-5f32), ("bfloat16", 1e-2)] {
            let kernel = hub
                .find(&KernelRequest {
                    name: "flash_attention",
                    shape: &shape,
                    dtype,
                    target: KernelTarget::Interpret,
                })
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                !kernel.mlir.contains("custom_call"),
                "{dtype}: not plain StableHLO"
            );
            let exe = client
                .compile(&kernel.mlir, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{shape:?} {dtype}: {e}"));
            let (out, inputs) = if dtype == "float32" {
                let b = |x: &[f32]| client.buffer_from_slice(x, &dims, &device).unwrap();
                let args = [b(&q), b(&k), b(&v)];
                let out = exe.execute(&args.iter().collect::<Vec<_>>()).unwrap();
                (
                    out[0].to_vec::<f32>().unwrap(),
                    [q.clone(), k.clone(), v.clone()],
                )
            } else {
                let half = |x: &[f32]| {
                    x.iter()
                        .map(|&f| half::bf16::from_f32(f))
                        .collect::<Vec<_>>()
                };
                let widen = |x: &[half::bf16]| x.iter().map(|h| h.to_f32()).collect::<Vec<f32>>();
                let (hq, hk, hv) = (half(&q), half(&k), half(&v));
                let b = |x: &[half::bf16]| client.buffer_from_slice(x, &dims, &device).unwrap();
                let args = [b(&hq), b(&hk), b(&hv)];
                let out = exe.execute(&args.iter().collect::<Vec<_>>()).unwrap();
                let out: Vec<half::bf16> = out[0].to_vec().unwrap();
                (widen(&out), [widen(&hq), widen(&hk), widen(&hv)])
            };
            assert_eq!(out.len(), n, "{shape:?} {dtype}: output size");
            let expected =
                plain_attention(&inputs[0], &inputs[1], &inputs[2], shape, kernel.sm_scale);
            let err = relative_error(&out, &expected);
            eprintln!(
                "flash attention {shape:?} ({dtype}, interpret mode) vs plain: relative error {err:e}"
            );
            assert!(err <= tolerance, "{shape:?} {dtype}: {err:e}");
        }
    }
}

/// What the hub cannot serve is one line saying why (so the plain lowering is used): another
/// shape, another TPU generation, a damaged artifact or manifest, another jax version, an
/// unknown kernel.
#[test]
fn the_kernel_hub_refuses_what_does_not_match_with_a_one_line_reason() {
    use oxidiff::backend::kernels::{KernelHub, KernelRequest, KernelTarget};
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("flash_attention");
    std::fs::create_dir(&copy).unwrap();
    for entry in std::fs::read_dir(kernel_hub_dir().join("flash_attention")).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, copy.join(path.file_name().unwrap())).unwrap();
    }
    let request = |shape: &'static [usize], target: KernelTarget| KernelRequest {
        name: "flash_attention",
        shape,
        dtype: "bfloat16",
        target,
    };
    let v5e = || KernelTarget::Tpu("v5e".into());
    let miss = |hub: &KernelHub, r: KernelRequest<'_>| {
        let text = hub
            .find(&r)
            .map(|k| k.file.display().to_string())
            .unwrap_err()
            .to_string();
        assert!(!text.contains('\n'), "{text}");
        text
    };
    let hub = KernelHub::open(tmp.path());
    assert!(hub.find(&request(&[2, 8, 4096, 40], v5e())).is_ok());
    let text = miss(&hub, request(&[2, 8, 1024, 40], v5e()));
    assert!(
        text.contains("no artifact for [2, 8, 1024, 40]")
            && text.contains("[2, 8, 4096, 40] bfloat16"),
        "{text}"
    );
    let text = miss(
        &hub,
        request(&[2, 8, 4096, 40], KernelTarget::Tpu("v4".into())),
    );
    assert!(
        text.contains("not exported for TPU v4") && text.contains("v5e, v6e"),
        "{text}"
    );
    let text = miss(
        &hub,
        KernelRequest {
            name: "ring_attention",
            ..request(&[1], v5e())
        },
    );
    assert!(text.contains("no kernel `ring_attention`"), "{text}");

    // A flipped byte in the artifact.
    let file = copy.join("tpu-bfloat16-2x8x4096x40.mlir");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&file, bytes).unwrap();
    let text = miss(&hub, request(&[2, 8, 4096, 40], v5e()));
    assert!(
        text.contains("is damaged (sha256") && text.contains("tpu-bfloat16-2x8x4096x40.mlir"),
        "{text}"
    );

    // Another jax version, then a manifest that is not JSON.
    let manifest = copy.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(
        &manifest,
        text.replace("\"jax\": \"0.10.2\"", "\"jax\": \"0.9.0\""),
    )
    .unwrap();
    let text = miss(
        &KernelHub::open(tmp.path()),
        request(&[1, 2, 128, 64], v5e()),
    );
    assert!(text.contains("exported with jax 0.9.0"), "{text}");
    std::fs::write(&manifest, "{ not json").unwrap();
    let text = miss(
        &KernelHub::open(tmp.path()),
        request(&[1, 2, 128, 64], v5e()),
    );
    assert!(text.contains("manifest.json is damaged"), "{text}");
}

/// With the kernel hub enabled (`OXIDIFF_KERNELS`, interpret-mode artifacts on XLA's CPU
/// plugin), the compiled UNet step calls the flash attention kernel for each of tiny-sd1's 16
/// self-attentions (the cross-attentions, whose keys are the 77 text tokens, and the VAE's
/// single-head attention have no bucket and stay plain), and the image is the one without
/// kernels within 1 PNG level (f32: blockwise online softmax against one softmax).
#[test]
fn a_pipeline_with_hub_kernels_spliced_in_gives_the_same_image() {
    use oxidiff::backend::eager::XLA_CPU_DEVICES_ENV;
    use oxidiff::backend::kernels::{KERNELS_ENV, KERNEL_TARGET_ENV};
    if skip() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let run = |name: &str, kernels: bool, extra: &[&str]| {
        let out = tmp.path().join(format!("{name}.png"));
        let mut command = Command::new(env!("CARGO_BIN_EXE_txt2img"));
        command
            .arg("--model")
            .arg(model_dir("tiny-sd1"))
            .args([
                "--steps", "4", "--seed", "7", "--width", "64", "--height", "64",
            ])
            .args(["--device", "xla:cpu", "--compile", "--quiet"])
            .args(extra)
            .env(XLA_CPU_DEVICES_ENV, "2")
            .arg("-o")
            .arg(&out)
            .arg("a photo of an astronaut riding a horse")
            .env(
                "OXIDIFF_COMPILE_CACHE",
                tmp.path().join(format!("cache-{name}")),
            )
            .env("OXIDIFF_LOG_COMPILES", "1")
            .env_remove(KERNELS_ENV)
            .env_remove(KERNEL_TARGET_ENV);
        if kernels {
            command
                .env(KERNELS_ENV, kernel_hub_dir())
                .env(KERNEL_TARGET_ENV, "interpret");
        }
        let result = command.output().expect("txt2img runs");
        let log = String::from_utf8_lossy(&result.stderr).into_owned();
        assert!(result.status.success(), "{name}: {log}");
        (image::open(&out).unwrap().to_rgb8(), log)
    };
    let (plain, log) = run("plain", false, &[]);
    assert!(!log.contains("kernel hub calls"), "{log}");
    // One device, and split over two with `--tp 2`: each device's kernel call runs on its own
    // four of the eight heads (a manual-sharding region, with the hub's per-device kernels).
    for (name, extra) in [("kernels", &[][..]), ("kernels-tp2", &["--tp", "2"][..])] {
        let (spliced, log) = run(name, true, extra);
        assert!(
            log.contains("16 attentions as kernel hub calls"),
            "{name}: the UNet step's self-attentions were not spliced: {log}"
        );
        let worst = common::png_level_diff(&plain, &spliced);
        eprintln!("tiny-sd1 {extra:?} with hub flash attention: {worst} PNG levels off the plain lowering");
        assert!(worst <= 1, "{name}: {worst} PNG levels");
    }
}

/// `len` values spread evenly over `[-width / 2, width / 2)` from a 64-bit LCG at `seed`.
fn uniform(seed: &mut u64, len: usize, width: f32) -> Vec<f32> {
    (0..len)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * width
        })
        .collect()
}

const ALONE_ENV: &str = "OXIDIFF_COMPILED_MODE_ALONE";

/// The host kernels' call counts are process-wide, and other tests of this binary call the same
/// kernels at the same time: a test that counts calls runs again, alone, in a child process.
/// True in that child; in the parent, runs the child, asserts that it passed, and is false.
fn alone_in_a_child(test: &str) -> bool {
    if std::env::var(ALONE_ENV).as_deref() == Ok(test) {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ALONE_ENV, test)
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprint!("{stderr}");
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{test}, alone in a child process, failed:\n{stdout}\n{stderr}"
    );
    false
}

/// `x` `[n, c, h, w]` convolved with `w` `[o, c, k, k]` (stride `s`, padding `p`) in f64.
fn conv2d_f64(
    x: &[f32],
    xd: [usize; 4],
    w: &[f32],
    wd: [usize; 4],
    s: usize,
    p: usize,
) -> Vec<f32> {
    let ([n, c, h, wi], [o, _, k, _]) = (xd, wd);
    let (ho, wo) = ((h + 2 * p - k) / s + 1, (wi + 2 * p - k) / s + 1);
    let mut out = vec![0.0f32; n * o * ho * wo];
    for (b, oc, oy, ox) in (0..n).flat_map(|b| {
        (0..o)
            .flat_map(move |oc| (0..ho).flat_map(move |oy| (0..wo).map(move |ox| (b, oc, oy, ox))))
    }) {
        let mut sum = 0.0f64;
        for (ic, ky, kx) in
            (0..c).flat_map(|ic| (0..k).flat_map(move |ky| (0..k).map(move |kx| (ic, ky, kx))))
        {
            let (y, xx) = (
                (oy * s + ky) as isize - p as isize,
                (ox * s + kx) as isize - p as isize,
            );
            if y < 0 || xx < 0 || y >= h as isize || xx >= wi as isize {
                continue;
            }
            let xv = x[((b * c + ic) * h + y as usize) * wi + xx as usize];
            sum += f64::from(xv) * f64::from(w[((oc * c + ic) * k + ky) * k + kx]);
        }
        out[((b * o + oc) * ho + oy) * wo + ox] = sum as f32;
    }
    out
}

/// On XLA's CPU plugin, compiled programs run their f32 convolutions in oxidiff's CPU kernel
/// (a typed XLA FFI custom call, `oxidiff::pipelines::host_kernels`): each shape below, on odd
/// sizes, through im2col (small planes, stride 2, a 1x1 kernel) and Winograd F(4x4, 3x3) (a
/// 40x36 plane), matches an f64 convolution within 1e-5 of its largest output, with the bias
/// (an operand of the call) added; the kernel runs once per convolution per call. A grouped
/// convolution, which the kernel does not take, stays on XLA's own lowering and matches too.
#[test]
fn compiled_convolutions_call_the_cpu_kernel_on_xla_cpu() {
    use burn::tensor::module::conv2d;
    use burn::tensor::ops::ConvOptions;
    use oxidiff::backend::host_kernels::{self, CONV2D_F32};
    use oxidiff::backend::CompiledFn;
    if skip() || !alone_in_a_child("compiled_convolutions_call_the_cpu_kernel_on_xla_cpu") {
        return;
    }
    oxidiff::pipelines::host_kernels::install();
    let device = xla();
    let mut seed = 7u64;
    let mut random = |len: usize| uniform(&mut seed, len, 1.0);
    // (input, kernel, stride, padding)
    let cases: [([usize; 4], [usize; 4], usize, usize); 4] = [
        ([2, 5, 13, 11], [7, 5, 3, 3], 1, 1),
        ([1, 3, 40, 36], [6, 3, 3, 3], 1, 1),
        ([2, 4, 15, 9], [5, 4, 3, 3], 2, 1),
        ([1, 6, 7, 5], [3, 6, 1, 1], 1, 0),
    ];
    for (xd, wd, s, p) in cases {
        let (x, w, bias) = (
            random(xd.iter().product()),
            random(wd.iter().product()),
            random(wd[0]),
        );
        let to = |v: &[f32], shape: [usize; 4]| {
            Tensor::<Oxi, 4>::from_data(TensorData::new(v.to_vec(), shape), &device)
        };
        let bt = Tensor::<Oxi, 1>::from_data(TensorData::new(bias.clone(), [wd[0]]), &device);
        let wt = to(&w, wd);
        let options = ConvOptions::new([s, s], [p, p], [1, 1], 1);
        let f = CompiledFn::new("conv", move |x: Tensor<Oxi, 4>| {
            conv2d(x, wt.clone(), Some(bt.clone()), options.clone())
        });
        let before = host_kernels::calls(CONV2D_F32);
        let out = to_vec(f.call(to(&x, xd)).unwrap());
        assert_eq!(
            host_kernels::calls(CONV2D_F32),
            before + 1,
            "{xd:?} {wd:?}: one kernel call"
        );
        let mut expected = conv2d_f64(&x, xd, &w, wd, s, p);
        let plane = expected.len() / (xd[0] * wd[0]);
        for (i, v) in expected.iter_mut().enumerate() {
            *v += bias[(i / plane) % wd[0]];
        }
        let scale = expected.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let worst = out
            .iter()
            .zip(&expected)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("{xd:?} * {wd:?} stride {s}: largest difference {worst:e} of {scale}");
        assert!(
            worst <= 1e-5 * scale,
            "{xd:?} {wd:?}: {worst:e} against {scale}"
        );
    }
    // Two groups: XLA's own convolution.
    let (xd, wd) = ([1, 4, 9, 9], [6, 2, 3, 3]);
    let (x, w) = (random(324), random(108));
    let wt = Tensor::<Oxi, 4>::from_data(TensorData::new(w.clone(), wd), &device);
    let options = ConvOptions::new([1, 1], [1, 1], [1, 1], 2);
    let f = CompiledFn::new("grouped", move |x: Tensor<Oxi, 4>| {
        conv2d(x, wt.clone(), None, options.clone())
    });
    let before = host_kernels::calls(CONV2D_F32);
    let out = to_vec(
        f.call(Tensor::<Oxi, 4>::from_data(
            TensorData::new(x.clone(), xd),
            &device,
        ))
        .unwrap(),
    );
    assert_eq!(
        host_kernels::calls(CONV2D_F32),
        before,
        "grouped: not the kernel's"
    );
    let half = |v: &[f32], per: usize, g: usize| v[g * per..(g + 1) * per].to_vec();
    for g in 0..2 {
        let expected = conv2d_f64(
            &half(&x, 162, g),
            [1, 2, 9, 9],
            &half(&w, 54, g),
            [3, 2, 3, 3],
            1,
            1,
        );
        let got = &out[g * 243..(g + 1) * 243];
        assert!(relative_error(got, &expected) <= 1e-5, "group {g}");
    }
}

/// softmax(q k^T * scale) v in f64 for `[batch, heads, seq, dim]` inputs, causal (query `i` sees
/// keys `0..=i`) when asked.
fn attention_f64(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    [b, h, lq, lk, d]: [usize; 5],
    scale: f64,
    causal: bool,
) -> Vec<f32> {
    let mut out = vec![0.0f32; b * h * lq * d];
    for bh in 0..b * h {
        for i in 0..lq {
            let keys = if causal { i + 1 } else { lk };
            let scores: Vec<f64> = (0..keys)
                .map(|j| {
                    (0..d)
                        .map(|c| {
                            f64::from(q[(bh * lq + i) * d + c])
                                * f64::from(k[(bh * lk + j) * d + c])
                        })
                        .sum::<f64>()
                        * scale
                })
                .collect();
            let max = scores.iter().fold(f64::MIN, |m, &s| m.max(s));
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for c in 0..d {
                let y: f64 = (0..keys)
                    .map(|j| e[j] * f64::from(v[(bh * lk + j) * d + c]))
                    .sum();
                out[(bh * lq + i) * d + c] = (y / sum) as f32;
            }
        }
    }
    out
}

/// On XLA's CPU plugin, compiled f32 attention runs in oxidiff's CPU kernel (flash attention,
/// or the blocked kernel when causal): on odd shapes (37 queries over 29 keys, 3 heads of 40;
/// causal over 17) it matches an f64 attention within 1e-5 relative, one call each. A custom
/// scale, which the kernel does not take, stays on XLA's lowering and matches too.
#[test]
fn compiled_attention_calls_the_cpu_kernel_on_xla_cpu() {
    use burn::tensor::module::attention;
    use burn::tensor::ops::AttentionModuleOptions;
    use oxidiff::backend::host_kernels::{self, ATTENTION_F32};
    use oxidiff::backend::CompiledFn;
    if skip() || !alone_in_a_child("compiled_attention_calls_the_cpu_kernel_on_xla_cpu") {
        return;
    }
    oxidiff::pipelines::host_kernels::install();
    let device = xla();
    let mut seed = 11u64;
    let mut random = |len: usize| uniform(&mut seed, len, 2.0);
    // ([batch, heads, queries, keys, dim], causal, scale, through the kernel)
    let cases = [
        ([2, 3, 37, 29, 40], false, None, true),
        ([1, 2, 17, 17, 24], true, None, true),
        ([1, 2, 9, 13, 8], false, Some(0.3), false),
    ];
    for (dims, causal, scale, kernel) in cases {
        let [b, h, lq, lk, d] = dims;
        let (q, k, v) = (
            random(b * h * lq * d),
            random(b * h * lk * d),
            random(b * h * lk * d),
        );
        let tensor = |x: &[f32], seq: usize| {
            Tensor::<Oxi, 4>::from_data(TensorData::new(x.to_vec(), [b, h, seq, d]), &device)
        };
        let (kt, vt) = (tensor(&k, lk), tensor(&v, lk));
        let options = AttentionModuleOptions {
            scale,
            softcap: None,
            is_causal: causal,
        };
        let f = CompiledFn::new("attention", move |q: Tensor<Oxi, 4>| {
            attention(q, kt.clone(), vt.clone(), None, None, options)
        });
        let before = host_kernels::calls(ATTENTION_F32);
        let out = to_vec(f.call(tensor(&q, lq)).unwrap());
        let calls = host_kernels::calls(ATTENTION_F32) - before;
        assert_eq!(calls, u64::from(kernel), "{dims:?}: kernel calls");
        let scale = scale.unwrap_or(1.0 / (d as f64).sqrt());
        let expected = attention_f64(&q, &k, &v, dims, scale, causal);
        let error = relative_error(&out, &expected);
        eprintln!("attention {dims:?} causal {causal}: relative error {error:e}");
        assert!(error <= 1e-5, "{dims:?}: {error:e}");
    }
}

/// `a` `[batch, m, k]` times `b` `[batch, k, n]` (or `[1, k, n]`, the same for every batch) in
/// f64.
fn matmul_f64(a: &[f32], b: &[f32], [batch, m, k, n]: [usize; 4]) -> Vec<f32> {
    let shared = b.len() == k * n;
    let mut out = vec![0.0f32; batch * m * n];
    for (i, o) in out.iter_mut().enumerate() {
        let (s, row, col) = (i / (m * n), i / n % m, i % n);
        let rhs = if shared { 0 } else { s * k * n };
        *o = (0..k)
            .map(|j| f64::from(a[(s * m + row) * k + j]) * f64::from(b[rhs + j * n + col]))
            .sum::<f64>() as f32;
    }
    out
}

/// On XLA's CPU plugin, a compiled f32 product with a 2-D right side (a layer's `linear`, or a
/// `matmul` whose right side is the same for every batch) runs in oxidiff's CPU kernel (the
/// `gemm` crate): on odd shapes (3x37 rows of 29 into 45 with a bias, 2x5 batches of 33x19
/// times 19x23, one row of 70) it matches an f64 product within 1e-5 relative, one call each.
/// A product batched on both sides stays on XLA's `dot_general` and matches too.
#[test]
fn compiled_matmuls_call_the_cpu_kernel_on_xla_cpu() {
    use burn::tensor::module::linear;
    use oxidiff::backend::host_kernels::{self, MATMUL_F32};
    use oxidiff::backend::CompiledFn;
    if skip() || !alone_in_a_child("compiled_matmuls_call_the_cpu_kernel_on_xla_cpu") {
        return;
    }
    oxidiff::pipelines::host_kernels::install();
    let device = xla();
    let mut seed = 13u64;
    let mut random = |len: usize| uniform(&mut seed, len, 2.0);
    let check = |what: &str, out: Vec<f32>, expected: &[f32], calls: u64| {
        let error = relative_error(&out, expected);
        eprintln!("{what}: relative error {error:e}, {calls} kernel calls");
        assert!(error <= 1e-5, "{what}: {error:e}");
    };

    // A layer: x [3, 37, 29] W [29, 45] + b.
    let (x, w, bias) = (random(3 * 37 * 29), random(29 * 45), random(45));
    let wt = Tensor::<Oxi, 2>::from_data(TensorData::new(w.clone(), [29, 45]), &device);
    let bt = Tensor::<Oxi, 1>::from_data(TensorData::new(bias.clone(), [45]), &device);
    let f = CompiledFn::new("linear", move |x: Tensor<Oxi, 3>| {
        linear(x, wt.clone(), Some(bt.clone()))
    });
    let before = host_kernels::calls(MATMUL_F32);
    let out = to_vec(
        f.call(Tensor::from_data(
            TensorData::new(x.clone(), [3, 37, 29]),
            &device,
        ))
        .unwrap(),
    );
    let calls = host_kernels::calls(MATMUL_F32) - before;
    let mut expected = matmul_f64(&x, &w, [1, 3 * 37, 29, 45]);
    for (i, v) in expected.iter_mut().enumerate() {
        *v += bias[i % 45];
    }
    check("linear [3, 37, 29] x [29, 45]", out, &expected, calls);
    assert_eq!(calls, 1, "linear: kernel calls");

    // `matmul`s: (left, right, through the kernel).
    let cases: [([usize; 4], [usize; 4], bool); 3] = [
        ([2, 5, 33, 19], [1, 1, 19, 23], true),
        ([1, 1, 1, 70], [1, 1, 70, 3], true),
        ([1, 2, 7, 11], [1, 2, 11, 5], false),
    ];
    for (ad, bd, kernel) in cases {
        let (a, b) = (random(ad.iter().product()), random(bd.iter().product()));
        let bt = Tensor::<Oxi, 4>::from_data(TensorData::new(b.clone(), bd), &device);
        let f = CompiledFn::new("matmul", move |a: Tensor<Oxi, 4>| a.matmul(bt.clone()));
        let before = host_kernels::calls(MATMUL_F32);
        let out = to_vec(
            f.call(Tensor::from_data(TensorData::new(a.clone(), ad), &device))
                .unwrap(),
        );
        let calls = host_kernels::calls(MATMUL_F32) - before;
        let expected = matmul_f64(&a, &b, [ad[0] * ad[1], ad[2], ad[3], bd[3]]);
        check(&format!("matmul {ad:?} x {bd:?}"), out, &expected, calls);
        assert_eq!(calls, u64::from(kernel), "{ad:?} x {bd:?}: kernel calls");
    }
}
