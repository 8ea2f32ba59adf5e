//! The compiled denoising step of the tiny SD pipeline (UNet and classifier-free guidance, as
//! `pipe.compile()` runs it) compiled ahead of time for TPU v5e and v6e with libtpu, on a
//! machine without a TPU (`tools/fetch-plugins.sh --only tpu`), with XLA's cost analysis read
//! back; the VAE's programs likewise. Its own test binary, so libtpu stays out of the XLA CPU
//! plugin's processes.

mod common;

use oxidiff::backend::pjrt::{CompileOptions, Error, Plugin};
use oxidiff::pipelines::aot::{trace_guided_step, TracedPart};

/// Environment variable: `1` compiles each released denoiser for TPU v5e and v6e, not only the
/// generation its test names (about twice the time).
const EVERY_GENERATION_ENV: &str = "OXIDIFF_AOT_EVERY_GENERATION";

fn libtpu() -> Option<Plugin> {
    match Plugin::discover("tpu") {
        Ok(plugin) => Some(plugin),
        Err(e @ Error::PluginNotFound { .. })
            if std::env::var("OXIDIFF_SKIP_PJRT_TESTS").as_deref() == Ok("1") =>
        {
            eprintln!("skipped (OXIDIFF_SKIP_PJRT_TESTS=1): {e}");
            None
        }
        Err(e) => panic!("{e}\n(set OXIDIFF_SKIP_PJRT_TESTS=1 to skip PJRT tests instead)"),
    }
}

/// The ids of a topology's devices, for `CompileOptions::spmd`.
fn device_ids(topology: &oxidiff::backend::pjrt::Topology) -> Vec<i64> {
    topology
        .devices()
        .unwrap_or_else(|e| panic!("{e}"))
        .iter()
        .map(|d| i64::from(d.id))
        .collect()
}

/// Compiles each traced part for `topology_name` through libtpu, checks it has one output and
/// reads at least its weights' bytes, and returns each one's flops.
fn part_flops(plugin: &Plugin, topology_name: &str, programs: &[(&str, TracedPart)]) -> Vec<f64> {
    let topology = plugin
        .topology(topology_name, &[])
        .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
    programs
        .iter()
        .map(|(what, traced)| {
            let exe = topology
                .compile(&traced.module, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{topology_name} {what}: {e}"));
            assert_eq!(exe.num_outputs().ok(), Some(1));
            let cost = exe.cost_analysis().unwrap_or_else(|e| panic!("{e}"));
            let f = cost.flops().expect("XLA reports flops");
            let bytes = cost.bytes_accessed().expect("XLA reports bytes accessed");
            eprintln!("{topology_name} {what}: {f:.4e} flops, {bytes:.4e} bytes accessed");
            assert!(
                bytes >= traced.weight_bytes as f64,
                "{what}: {bytes} bytes accessed, fewer than its {} bytes of weights",
                traced.weight_bytes
            );
            f
        })
        .collect()
}

#[test]
fn tiny_compiled_unet_step_compiles_ahead_of_time_for_tpu_v5e_and_v6e() {
    let Some(plugin) = libtpu() else {
        return;
    };
    let unet = common::model_dir("tiny-sd1").join("unet");
    // 64x64 images: 8x8 latents, the fixture's sample size.
    let guided = trace_guided_step(&unet, None, 1, 8, 8, true).unwrap_or_else(|e| panic!("{e}"));
    let plain = trace_guided_step(&unet, None, 1, 8, 8, false).unwrap_or_else(|e| panic!("{e}"));
    // The weights are arguments of the program (device buffers at run time), not constants.
    assert!(guided.weights > 50, "{} weight arguments", guided.weights);
    eprintln!(
        "traced step: {} ops, {} KiB of StableHLO, {} weight arguments ({} KiB)",
        guided.ops,
        guided.module.len() / 1024,
        guided.weights,
        guided.weight_bytes / 1024
    );

    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let topology = plugin
            .topology(topology_name, &[])
            .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
        // The unguided step once (each compile takes tens of seconds here).
        let steps: &[&_] = if topology_name.starts_with("v5e") {
            &[&guided, &plain]
        } else {
            &[&guided]
        };
        let mut flops = Vec::new();
        for step in steps {
            let started = std::time::Instant::now();
            let exe = topology
                .compile(&step.module, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let compile = started.elapsed();
            assert_eq!(exe.num_outputs().ok(), Some(1));
            let code = exe
                .generated_code_size()
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let cost = exe
                .cost_analysis()
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let serialized = exe.serialize().unwrap_or_else(|e| panic!("{e}")).len();
            let f = cost.flops().expect("XLA reports flops");
            let bytes = cost.bytes_accessed().expect("XLA reports bytes accessed");
            eprintln!(
                "{topology_name} guidance={}: compiled in {compile:.2?}, {code} bytes of code, {serialized} serialized; {f:.4e} flops, {bytes:.4e} bytes accessed; all properties: {:?}",
                step.guidance, cost.properties
            );
            assert!(code > 0, "generated code size {code}");
            assert!(f > 0.0 && bytes > 0.0);
            // Every weight is read at least once.
            assert!(
                bytes >= step.weight_bytes as f64,
                "{bytes} bytes accessed, fewer than the {} bytes of weights",
                step.weight_bytes
            );
            flops.push(f);
        }
        // Guidance runs the UNet on twice the batch: about twice the flops.
        if let [guided, plain] = flops[..] {
            let ratio = guided / plain;
            assert!(
                (1.8..=2.2).contains(&ratio),
                "{topology_name}: guided/plain flops {ratio}"
            );
        }
    }
}

/// The compiled step partitioned over the 8 chips of a v6e-8 (libtpu, no TPU needed): tensor
/// parallel 8 (the tiny UNet's 8 heads per attention and feed-forward widths 64 and 128 divide
/// by 8) at batch 1 with guidance, and data parallel 8 at batch 8 (16 UNet rows with guidance);
/// XLA's SPMD partitioner inserts the all-reduces of the row-wise layers.
#[test]
fn tiny_parallel_step_compiles_ahead_of_time_for_v6e_8_with_tp_8_and_dp_8() {
    use oxidiff::backend::pjrt::hlo::opcode_counts;
    use oxidiff::pipelines::aot::trace_parallel_step;
    use oxidiff::pipelines::parallel::ParallelConfig;

    let Some(plugin) = libtpu() else {
        return;
    };
    // libtpu's names for 8 v6e chips; the first it accepts with 8 devices is used.
    let (name, topology) = ["v6e:2x4", "v6e:2x4x1", "v6e:2x2x2"]
        .into_iter()
        .find_map(|name| {
            let topology = plugin.topology(name, &[]).ok()?;
            (topology.devices().ok()?.len() == 8).then_some((name, topology))
        })
        .expect("libtpu knows an 8-chip v6e topology");
    let ids = device_ids(&topology);
    let unet = common::model_dir("tiny-sd1").join("unet");
    for (what, config, latents) in [
        ("tp 8", ParallelConfig::new(1, 8), [1, 8, 8]),
        ("dp 8", ParallelConfig::new(8, 1), [8, 8, 8]),
    ] {
        let step = trace_parallel_step(&unet, None, latents, true, &config, 8)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        assert_eq!(step.partitions, 8);
        assert!(step.module.contains("mhlo.num_partitions = 8"));
        let started = std::time::Instant::now();
        let exe = topology
            .compile(&step.module, &CompileOptions::spmd(&ids))
            .unwrap_or_else(|e| panic!("{name} {what}: {e}"));
        let (format, bytes) = exe.optimized_program().unwrap_or_else(|e| panic!("{e}"));
        let counts = opcode_counts(&format, &bytes).unwrap_or_else(|e| panic!("{e}"));
        let collectives: Vec<_> = counts
            .iter()
            .filter(|(op, _)| {
                op.starts_with("all-") || op.contains("collective") || op.contains("reduce-scatter")
            })
            .collect();
        let cost = exe.cost_analysis().unwrap_or_else(|e| panic!("{e}"));
        eprintln!(
            "{name} {what}: compiled in {:.2?}; {:.4e} flops per device; collectives {collectives:?}",
            started.elapsed(),
            cost.flops().unwrap_or(f64::NAN)
        );
        assert_eq!(exe.num_outputs().ok(), Some(1));
        if config.tp() > 1 {
            // One all-reduce after each of the 48 row-wise layers (observed: exactly 48).
            let all_reduces: usize = ["all-reduce", "all-reduce-start"]
                .iter()
                .filter_map(|op| counts.get(*op))
                .sum();
            assert!(all_reduces >= 48, "{collectives:?}");
        }
    }
}

/// The VAE programs of compiled mode (`compile_vae`: the encoder and the decoder, each one
/// program per input shape) compile ahead of time for TPU v5e and v6e: each reads all of its
/// weights, and the decoder does about twice the flops on a batch of 2 as on a batch of 1.
#[test]
fn tiny_vae_programs_compile_ahead_of_time_for_tpu_v5e_and_v6e() {
    use oxidiff::pipelines::aot::{trace_vae, VaeHalf};

    let Some(plugin) = libtpu() else {
        return;
    };
    let vae = common::model_dir("tiny-sd1").join("vae");
    let trace = |half| trace_vae(&vae, None, half).unwrap_or_else(|e| panic!("{half:?}: {e}"));
    let decoder = |batch| VaeHalf::Decoder {
        batch,
        latent_height: 8,
        latent_width: 8,
    };
    let encoder = VaeHalf::Encoder {
        batch: 1,
        height: 64,
        width: 64,
    };
    let programs = [
        ("decoder, batch 1", trace(decoder(1))),
        ("decoder, batch 2", trace(decoder(2))),
        ("encoder", trace(encoder)),
    ];
    for (what, traced) in &programs {
        assert!(traced.weights > 20, "{what}: {} weights", traced.weights);
    }
    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let flops = part_flops(&plugin, topology_name, &programs);
        let ratio = flops[1] / flops[0];
        assert!(
            (1.8..=2.2).contains(&ratio),
            "{topology_name}: decoder batch 2 / batch 1 flops {ratio}"
        );
    }
}

/// The text encoders' programs (CLIP's layers, T5's blocks: what `compile()` installs for SD,
/// SDXL, SD3, Flux and PixArt) compile ahead of time for TPU v5e and v6e; twice the tokens cost
/// at least twice the flops.
#[test]
fn tiny_text_encoder_programs_compile_ahead_of_time_for_tpu_v5e_and_v6e() {
    use oxidiff::pipelines::aot::{trace_text_encoder, TextEncoderPart};

    let Some(plugin) = libtpu() else {
        return;
    };
    let clip = common::model_dir("tiny-sd1").join("text_encoder");
    let t5 = common::model_dir("tiny-pixart-alpha").join("text_encoder");
    let trace = |dir: &std::path::Path, part| {
        trace_text_encoder(dir, None, part).unwrap_or_else(|e| panic!("{part:?}: {e}"))
    };
    let programs = [
        (
            "CLIP, 77 tokens",
            trace(
                &clip,
                TextEncoderPart::Clip {
                    batch: 2,
                    tokens: 77,
                },
            ),
        ),
        (
            "T5, 16 tokens",
            trace(
                &t5,
                TextEncoderPart::T5 {
                    batch: 2,
                    tokens: 16,
                },
            ),
        ),
        (
            "T5, 32 tokens",
            trace(
                &t5,
                TextEncoderPart::T5 {
                    batch: 2,
                    tokens: 32,
                },
            ),
        ),
    ];
    for (what, traced) in &programs {
        assert!(traced.weights > 10, "{what}: {} weights", traced.weights);
    }
    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let flops = part_flops(&plugin, topology_name, &programs);
        let ratio = flops[2] / flops[1];
        assert!(
            ratio >= 1.9,
            "{topology_name}: T5 32 / 16 tokens flops {ratio}"
        );
    }
}

/// The compiled ControlNet step (two ControlNets, the UNet and guidance: what `compile()`
/// installs for the SD ControlNet pipelines) compiles ahead of time for TPU v5e and v6e, and
/// costs more flops than the UNet step alone.
#[test]
fn tiny_controlnet_step_compiles_ahead_of_time_for_tpu_v5e_and_v6e() {
    use oxidiff::pipelines::aot::{trace_controlled_step, trace_guided_step, TracedPart};

    let Some(plugin) = libtpu() else {
        return;
    };
    let unet = common::model_dir("tiny-sd1").join("unet");
    let nets = [
        common::model_dir("tiny-controlnet-sd1"),
        common::model_dir("tiny-controlnet-sd1-b"),
    ];
    let refs: Vec<&std::path::Path> = nets.iter().map(|d| d.as_path()).collect();
    let controlled = trace_controlled_step(&unet, &refs, 1, 8, 8).unwrap();
    let plain = trace_guided_step(&unet, None, 1, 8, 8, true).unwrap();
    let plain = TracedPart {
        module: plain.module,
        ops: plain.ops,
        weights: plain.weights,
        weight_bytes: plain.weight_bytes,
    };
    assert!(
        controlled.weights > plain.weights,
        "{} weights with ControlNets, {} without",
        controlled.weights,
        plain.weights
    );
    let programs = [("unet step", plain), ("controlnet step", controlled)];
    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let flops = part_flops(&plugin, topology_name, &programs);
        assert!(
            flops[1] > flops[0],
            "{topology_name}: the ControlNets add no flops ({flops:?})"
        );
    }
}

/// The kernel hub's Pallas flash attention (tools/kernels/export_flash_attention.py: a Mosaic
/// `tpu_custom_call`) compiles ahead of time for TPU v5e and v6e through oxidiff's own
/// topology path, at SD 1.5's 512x512 self-attention size (2 x 8 heads x 4096 tokens x 40), in
/// f32 and bf16, alone and spliced into oxidiff's own lowering of the attention (the module
/// compiled mode builds on a TPU); XLA's cost analysis of those and of the plain lowering of
/// the same attention (which materialises the 4096 x 4096 scores) are printed side by side,
/// and the kernel reads and writes fewer bytes.
#[test]
fn hub_flash_attention_compiles_for_tpu_v5e_and_v6e_and_accesses_fewer_bytes() {
    use burn::tensor::FloatDType;
    use oxidiff::backend::kernels::{AttentionKernels, KernelHub, KernelRequest, KernelTarget};
    use oxidiff::pipelines::aot::trace_attention;
    let Some(plugin) = libtpu() else {
        return;
    };
    let hub =
        KernelHub::open(&std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels"));
    let shape = [2usize, 8, 4096, 40];
    for (dtype, burn_dtype) in [("float32", FloatDType::F32), ("bfloat16", FloatDType::BF16)] {
        let plain = trace_attention(shape, burn_dtype, None).unwrap_or_else(|e| panic!("{e}"));
        for (topology_name, generation) in [("v5e:2x2x1", "v5e"), ("v6e:2x2x1", "v6e")] {
            let kernel = hub
                .find(&KernelRequest {
                    name: "flash_attention",
                    shape: &shape,
                    dtype,
                    target: KernelTarget::Tpu(generation.into()),
                })
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(kernel.mlir.contains("tpu_custom_call"));
            let topology = plugin
                .topology(topology_name, &[])
                .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
            let cost = |what: &str, module: &str| {
                let exe = topology
                    .compile(module, &CompileOptions::default())
                    .unwrap_or_else(|e| panic!("{topology_name} {dtype} {what}: {e}"));
                let cost = exe.cost_analysis().unwrap_or_else(|e| panic!("{e}"));
                let bytes = cost.bytes_accessed().unwrap_or(0.0);
                let flops = cost.flops().unwrap_or(0.0);
                eprintln!(
                    "{topology_name} {dtype} attention {shape:?}, {what}: {flops:.4e} flops, \
                     {bytes:.4e} bytes accessed"
                );
                bytes
            };
            let kernel_bytes = cost("Pallas flash attention (hub)", &kernel.mlir);
            let plain_bytes = cost("plain lowering", &plain.module);
            assert!(
                kernel_bytes > 0.0 && kernel_bytes < plain_bytes,
                "{topology_name} {dtype}: kernel {kernel_bytes} bytes, plain {plain_bytes}"
            );
            let kernels = AttentionKernels::new(hub.clone(), KernelTarget::Tpu(generation.into()));
            let spliced = trace_attention(shape, burn_dtype, Some(std::sync::Arc::new(kernels)))
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(spliced.module.contains("tpu_custom_call"), "not spliced");
            let spliced_bytes = cost(
                "oxidiff's lowering with the kernel spliced in",
                &spliced.module,
            );
            assert!(
                spliced_bytes < plain_bytes,
                "{topology_name} {dtype}: spliced {spliced_bytes} bytes, plain {plain_bytes}"
            );
        }
    }
}

/// A released denoiser of `tests/fixtures/aot` traced at `size` x `size` with `tokens` of text:
/// `attentions` attention ops, `spliced` of them kernel calls.
struct Released<'a> {
    name: &'a str,
    size: usize,
    tokens: usize,
    attentions: usize,
    spliced: usize,
}

impl<'a> Released<'a> {
    /// The weights `name` at `size` pixels with `tokens` of text: `attentions` in the
    /// program, `spliced` of them expected as kernel calls.
    fn of(name: &'a str, size: usize, tokens: usize, attentions: usize, spliced: usize) -> Self {
        Self {
            name,
            size,
            tokens,
            attentions,
            spliced,
        }
    }

    /// The denoiser program as `pipe.compile()` traces it, in bf16 from the weights header,
    /// with the kernel hub's TPU kernels for `generation` spliced in (partitioned as `parallel`
    /// asks); checks its attention and kernel-call counts and that a kernel is in it.
    fn trace(
        &self,
        generation: &str,
        parallel: Option<oxidiff::pipelines::aot::TraceParallel>,
    ) -> oxidiff::pipelines::aot::TracedStep {
        use burn::tensor::FloatDType;
        use oxidiff::backend::kernels::{AttentionKernels, KernelHub, KernelTarget};
        use oxidiff::pipelines::aot::{trace_denoiser, DenoiserInputs, TraceSettings};
        let Self {
            name,
            size,
            tokens,
            attentions,
            spliced,
        } = *self;
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let kernels = AttentionKernels::new(
            KernelHub::open(&root.join("kernels")),
            KernelTarget::Tpu(generation.into()),
        );
        let settings = TraceSettings {
            dtype: FloatDType::BF16,
            kernels: Some(std::sync::Arc::new(kernels)),
            parallel,
        };
        let inputs = DenoiserInputs {
            text_tokens: tokens,
            ..DenoiserInputs::image(size, size)
        };
        let dir = root.join("tests/fixtures/aot").join(name);
        let step =
            trace_denoiser(&dir, None, inputs, &settings).unwrap_or_else(|e| panic!("{name}: {e}"));
        eprintln!(
            "{name} {size}x{size}: {} ops, {} attentions, {} kernel calls",
            step.ops, step.attentions, step.kernel_calls
        );
        assert_eq!(
            (step.attentions, step.kernel_calls),
            (attentions, spliced),
            "{name} at {size}: attentions and kernel calls"
        );
        assert!(
            step.module.contains("tpu_custom_call"),
            "{name}: not spliced"
        );
        step
    }
}

/// The released SD 1.5 (512x512), SDXL base (1024x1024) and FLUX.1-dev (1024x1024) denoiser
/// programs, as `pipe.compile()` traces them in bf16, with the kernel hub's Pallas flash
/// attention spliced into every self-attention it has a bucket for, compile ahead of time for
/// TPU (one test each, so two compile at once). Flux-dev's 22.7 GB of weights fit one v6e chip
/// but not one v5e chip (XLA refuses it for want of HBM): on v5e it is split with `--tp 4` over a
/// 2x2 slice, each device's kernel calls on its own 6 of the 24 heads. The weights are headers
/// only (tests/fixtures/aot, from tools/kernels/make_weight_headers.py): tracing needs names,
/// shapes and dtypes, not the 3.4, 5.1 and 23.8 GB of values. The byte counts against the plain
/// lowering are docs/benchmarks.md's table (`tpu_roofline`). Each compile takes several minutes
/// on 2 cores, so each model compiles for `generation` (v5e or v6e), which between them the
/// three cover; [`EVERY_GENERATION_ENV`]`=1` compiles each for both. `case` says which weights,
/// at which size, and the attention and kernel-call counts expected.
fn released_denoiser_compiles_ahead_of_time_for_tpu(case: Released<'_>, generation: &str) {
    use oxidiff::pipelines::aot::TraceParallel;
    let Released {
        name,
        size,
        spliced,
        ..
    } = case;
    use oxidiff::pipelines::parallel::ParallelConfig;
    let Some(plugin) = libtpu() else {
        return;
    };
    let every = std::env::var(EVERY_GENERATION_ENV).is_ok_and(|v| v == "1");
    let generations = [("v5e:2x2x1", "v5e"), ("v6e:2x2x1", "v6e")]
        .into_iter()
        .filter(|&(_, g)| every || g == generation);
    for (topology_name, generation) in generations {
        let topology = plugin
            .topology(topology_name, &[])
            .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
        let mut step = case.trace(generation, None);
        let mut options = CompileOptions::default();
        if name.starts_with("flux") && generation == "v5e" {
            let err = topology
                .compile(&step.module, &options)
                .err()
                .expect("Flux-dev fits no single v5e chip")
                .to_string();
            assert!(err.contains("HBM"), "{err}");
            let ids = device_ids(&topology);
            step = case.trace(
                generation,
                Some(TraceParallel {
                    config: ParallelConfig::new(1, ids.len()),
                    devices: ids.len(),
                }),
            );
            assert!(step.module.contains("SPMDFullToShardShape"), "{name}");
            options = CompileOptions::spmd(&ids);
        }
        let exe = topology
            .compile(&step.module, &options)
            .unwrap_or_else(|e| panic!("{topology_name} {name}: {e}"));
        assert_eq!(exe.num_outputs().ok(), Some(1));
        let cost = exe.cost_analysis().unwrap_or_else(|e| panic!("{e}"));
        let flops = cost.flops().expect("XLA reports flops");
        let bytes = cost.bytes_accessed().expect("XLA reports bytes accessed");
        eprintln!(
            "{topology_name} {name} {size}x{size} bf16 on {} devices, {spliced} kernel \
                 calls: {flops:.4e} flops, {bytes:.4e} bytes accessed (per device)",
            step.partitions
        );
        // Every weight (each device's part of it) is read at least once and takes part in
        // at least one multiply-add (2 flops for its 2 bytes in bf16).
        let weight_bytes = step.weight_bytes as f64 / step.partitions as f64;
        assert!(bytes >= weight_bytes, "{name}: {bytes} bytes accessed");
        assert!(flops >= weight_bytes, "{name}: {flops} flops");
    }
}

/// SD 1.5's 16 self-attentions are spliced (the 160-channel heads of its 16x16 and 8x8 levels
/// with kernels padded to 256 channels); its 16 cross-attentions (77 keys) keep the plain
/// lowering.
#[test]
fn released_sd15_denoiser_with_hub_kernels_compiles_for_tpu_v5e() {
    released_denoiser_compiles_ahead_of_time_for_tpu(
        Released::of("sd15-unet", 512, 77, 32, 16),
        "v5e",
    );
}

/// SDXL's 70 self-attentions are spliced; its 70 cross-attentions keep the plain lowering.
#[test]
fn released_sdxl_denoiser_with_hub_kernels_compiles_for_tpu_v6e() {
    released_denoiser_compiles_ahead_of_time_for_tpu(
        Released::of("sdxl-unet", 1024, 77, 140, 70),
        "v6e",
    );
}

/// Flux's 57 joint attentions are all self-attention over 512 text and 4096 image tokens; on
/// v5e it is refused whole and compiled split over 4 chips.
#[test]
fn released_flux_denoiser_with_hub_kernels_compiles_for_tpu_v5e_split_over_4_chips() {
    released_denoiser_compiles_ahead_of_time_for_tpu(
        Released::of("flux-dev-transformer", 1024, 512, 57, 57),
        "v5e",
    );
}

/// Every TPU artifact of the kernel hub (each bucket of every model, also those whose sequence
/// is one odd-sized block, or padded to 128s with the padding masked, or whose head dim is
/// padded to 256) compiles with libtpu for every generation its manifest names, as the custom
/// call a spliced program carries; and its interpret twin exists, from the same export.
#[test]
fn every_hub_tpu_kernel_compiles_for_its_tpu_generations() {
    let Some(plugin) = libtpu() else {
        return;
    };
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("kernels/flash_attention");
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let artifacts = manifest["artifacts"].as_array().unwrap();
    let files: std::collections::HashSet<&str> = artifacts
        .iter()
        .map(|a| a["file"].as_str().unwrap())
        .collect();
    let mut compiled = 0;
    for (topology_name, generation) in [("v5e:2x2x1", "v5e"), ("v6e:2x2x1", "v6e")] {
        let topology = plugin
            .topology(topology_name, &[])
            .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
        for artifact in artifacts.iter().filter(|a| a["target"] == "tpu") {
            let file = artifact["file"].as_str().unwrap();
            assert!(
                files.contains(file.replacen("tpu-", "interpret-", 1).as_str()),
                "{file}: no interpret twin"
            );
            let generations = artifact["tpu_generations"].as_array().unwrap();
            if !generations.iter().any(|g| g == generation) {
                continue;
            }
            let mlir = std::fs::read_to_string(dir.join(file)).unwrap();
            assert!(mlir.contains("tpu_custom_call"), "{file}");
            let exe = topology
                .compile(&mlir, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{topology_name} {file}: {e}"));
            assert_eq!(exe.num_outputs().ok(), Some(1), "{file}");
            compiled += 1;
        }
    }
    eprintln!("{compiled} kernel compiles");
    assert!(compiled >= 40, "{compiled} kernel compiles");
}

/// The released SD 2.1 (768x768, and 512x512 as SD 2 base runs), SD3 Medium, SD3.5 Medium and
/// SD3.5 Large (1024x1024) denoiser programs, and Flux at FLUX.1-schnell's 256 text tokens, traced in bf16 from their weights headers as
/// `pipe.compile()` traces them, splice the hub's TPU flash attention into every
/// self-attention: SD 2.x's 16 (the 576- and 144-token levels at 768 as one block each; its 16
/// cross-attentions keep the plain lowering), SD3's joint attentions over 4096 image and 333
/// text tokens (padded to 4480 and masked), and SD3.5 Medium's 13 image-only second attentions.
/// Tracing only: whole-program TPU compiles of these take minutes each on this machine (the
/// SD 1.5, SDXL and Flux tests above compile theirs), and every kernel they call is compiled
/// by `every_hub_tpu_kernel_compiles_for_its_tpu_generations`.
#[test]
fn released_sd2_sd3_and_schnell_denoisers_splice_a_hub_kernel_into_every_self_attention() {
    let cases = [
        Released::of("sd21-unet", 768, 77, 32, 16),
        Released::of("sd21-unet", 512, 77, 32, 16),
        Released::of("sd3-medium-transformer", 1024, 333, 24, 24),
        Released::of("sd35-medium-transformer", 1024, 333, 37, 37),
        Released::of("sd35-large-transformer", 1024, 333, 38, 38),
        // FLUX.1-schnell's attention shapes: FLUX.1-dev's transformer over schnell's 256 text
        // tokens (the two differ in the guidance embedding, not in attention).
        Released::of("flux-dev-transformer", 1024, 256, 57, 57),
    ];
    for case in cases {
        case.trace("v6e", None);
    }
}

/// Compiled mode's scheduler steps, one fused program per step structure
/// ([`trace_scheduler_steps`]), compile ahead of time for TPU v5e and v6e: DPM++ 2M (its
/// history among the results), UniPC (predictor and corrector), Euler a (noise as an
/// argument) and SD3's flow-matching Euler; 20 steps need at most 4 programs each (UniPC's
/// first, second, middle and last steps differ).
#[test]
fn scheduler_step_programs_compile_ahead_of_time_for_tpu_v5e_and_v6e() {
    use oxidiff::pipelines::aot::trace_scheduler_steps;
    use oxidiff::schedulers::SchedulerConfig;

    let Some(plugin) = libtpu() else {
        return;
    };
    let config = |model: &str| {
        let path = common::model_dir(model).join("scheduler/scheduler_config.json");
        SchedulerConfig::from_file(&path).unwrap_or_else(|e| panic!("{e}"))
    };
    let sd = config("tiny-sd1");
    let named = |name: &str| sd.switched_to_named(name).unwrap_or_else(|e| panic!("{e}"));
    let cases = [
        ("DPM++ 2M", named("dpm++_2m"), [2, 4, 32, 32]),
        ("UniPC", named("unipc"), [2, 4, 32, 32]),
        ("Euler a", named("euler_a"), [2, 4, 32, 32]),
        (
            "SD3 flow-matching Euler",
            config("tiny-sd3"),
            [1, 16, 32, 32],
        ),
    ];
    let mut programs = Vec::new();
    for (what, scheduler, shape) in &cases {
        let parts =
            trace_scheduler_steps(scheduler, 20, *shape).unwrap_or_else(|e| panic!("{what}: {e}"));
        eprintln!("{what}: {} programs for 20 steps", parts.len());
        assert!(
            (1..=4).contains(&parts.len()),
            "{what}: {} step programs",
            parts.len()
        );
        programs.extend(parts.into_iter().map(|part| (*what, part)));
    }
    for topology_name in ["v5e:2x2x1", "v6e:2x2x1"] {
        let topology = plugin
            .topology(topology_name, &[])
            .unwrap_or_else(|e| panic!("{topology_name}: {e}"));
        for (what, part) in &programs {
            let exe = topology
                .compile(&part.module, &CompileOptions::default())
                .unwrap_or_else(|e| panic!("{topology_name} {what}: {e}"));
            let outputs = exe.num_outputs().unwrap_or_else(|e| panic!("{e}"));
            assert!(outputs >= 1, "{topology_name} {what}: {outputs} outputs");
        }
    }
}
