//! Times the SD 1.5 UNet's heaviest op shapes (256x256 images: 32x32 latents, CFG batch 2) as
//! single StableHLO programs on XLA's CPU plugin, to see which XLA CPU options and which
//! operand layouts make them fast. Each program is compiled with the backend's default
//! XLA CPU flags (`oxidiff::backend::pjrt::XLA_CPU_DEFAULT_FLAGS`; replace them with
//! `OXIDIFF_XLA_CPU_FLAGS`, add to them with `XLA_FLAGS`).
//!
//! `taskset -c 0 target/release/xla_cpu_ops [--repeat 5] [--only NAME]`

use std::time::Instant;

use anyhow::{Context, Result};
use oxidiff::backend::pjrt::{Buffer, CompileOptions, Plugin};
use oxidiff_examples::{arg, process_cpu_seconds};

/// (name, MLIR text, argument shapes)
fn programs() -> Vec<(&'static str, String, Vec<Vec<i64>>)> {
    let hi = "precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]";
    let module = |args: &str, ret: &str, body: &str| {
        format!(
            "module @bench {{\n  func.func public @main({args}) -> ({ret}) {{\n{body}\n  }}\n}}\n"
        )
    };
    let conv = |b: i64, c: i64, o: i64, hw: i64, k: i64, nhwc: bool| {
        let pad = k / 2;
        let (xt, wt, yt, dn) = if nhwc {
            (
                format!("tensor<{b}x{hw}x{hw}x{c}xf32>"),
                format!("tensor<{k}x{k}x{c}x{o}xf32>"),
                format!("tensor<{b}x{hw}x{hw}x{o}xf32>"),
                "[b, 0, 1, f]x[0, 1, i, o]->[b, 0, 1, f]",
            )
        } else {
            (
                format!("tensor<{b}x{c}x{hw}x{hw}xf32>"),
                format!("tensor<{o}x{c}x{k}x{k}xf32>"),
                format!("tensor<{b}x{o}x{hw}x{hw}xf32>"),
                "[b, f, 0, 1]x[o, i, 0, 1]->[b, f, 0, 1]",
            )
        };
        let body = format!(
            "    %0 = stablehlo.convolution(%arg0, %arg1) dim_numbers = {dn}, window = {{stride = [1, 1], pad = [[{pad}, {pad}], [{pad}, {pad}]], rhs_dilate = [1, 1]}} {{batch_group_count = 1 : i64, feature_group_count = 1 : i64, {hi}}} : ({xt}, {wt}) -> {yt}\n    return %0 : {yt}"
        );
        let (xs, ws) = if nhwc {
            (vec![b, hw, hw, c], vec![k, k, c, o])
        } else {
            (vec![b, c, hw, hw], vec![o, c, k, k])
        };
        (
            module(&format!("%arg0: {xt}, %arg1: {wt}"), &yt, &body),
            vec![xs, ws],
        )
    };
    let dot = |m: i64, k: i64, n: i64| {
        let body = format!(
            "    %0 = stablehlo.dot_general %arg0, %arg1, contracting_dims = [1] x [0], precision = [HIGHEST, HIGHEST] : (tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32>\n    return %0 : tensor<{m}x{n}xf32>"
        );
        (
            module(
                &format!("%arg0: tensor<{m}x{k}xf32>, %arg1: tensor<{k}x{n}xf32>"),
                &format!("tensor<{m}x{n}xf32>"),
                &body,
            ),
            vec![vec![m, k], vec![k, n]],
        )
    };
    let attention = |b: i64, h: i64, l: i64, d: i64| {
        let t = |x: &str| format!("tensor<{b}x{h}x{x}xf32>");
        let s = t(&format!("{l}x{l}"));
        let q = t(&format!("{l}x{d}"));
        let r = format!("tensor<{b}x{h}x{l}xf32>");
        let body = format!(
            "    %0 = stablehlo.dot_general %arg0, %arg1, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [3], precision = [HIGHEST, HIGHEST] : ({q}, {q}) -> {s}
    %c = stablehlo.constant dense<0.158113882> : tensor<f32>
    %cb = stablehlo.broadcast_in_dim %c, dims = [] : (tensor<f32>) -> {s}
    %1 = stablehlo.multiply %0, %cb : {s}
    %ninf = stablehlo.constant dense<0xFF800000> : tensor<f32>
    %2 = stablehlo.reduce(%1 init: %ninf) applies stablehlo.maximum across dimensions = [3] : ({s}, tensor<f32>) -> {r}
    %3 = stablehlo.broadcast_in_dim %2, dims = [0, 1, 2] : ({r}) -> {s}
    %4 = stablehlo.subtract %1, %3 : {s}
    %5 = stablehlo.exponential %4 : {s}
    %zero = stablehlo.constant dense<0.0> : tensor<f32>
    %6 = stablehlo.reduce(%5 init: %zero) applies stablehlo.add across dimensions = [3] : ({s}, tensor<f32>) -> {r}
    %7 = stablehlo.broadcast_in_dim %6, dims = [0, 1, 2] : ({r}) -> {s}
    %8 = stablehlo.divide %5, %7 : {s}
    %9 = stablehlo.dot_general %8, %arg2, batching_dims = [0, 1] x [0, 1], contracting_dims = [3] x [2], precision = [HIGHEST, HIGHEST] : ({s}, {q}) -> {q}
    return %9 : {q}"
        );
        (
            module(&format!("%arg0: {q}, %arg1: {q}, %arg2: {q}"), &q, &body),
            vec![vec![b, h, l, d]; 3],
        )
    };
    let mut out = Vec::new();
    let mut push = |name, (text, shapes): (String, Vec<Vec<i64>>)| out.push((name, text, shapes));
    push("conv3x3 2x320x32x32 nchw", conv(2, 320, 320, 32, 3, false));
    push("conv3x3 2x320x32x32 nhwc", conv(2, 320, 320, 32, 3, true));
    push("conv3x3 2x1280x8x8 nchw", conv(2, 1280, 1280, 8, 3, false));
    push("conv3x3 2x1280x8x8 nhwc", conv(2, 1280, 1280, 8, 3, true));
    push("conv1x1 2x640x16x16 nchw", conv(2, 640, 640, 16, 1, false));
    push("dot 2048x320x1280", dot(2048, 320, 1280));
    push("dot 512x640x640", dot(512, 640, 640));
    push("attention 2x8x1024x40", attention(2, 8, 1024, 40));
    out
}

fn main() -> Result<()> {
    let repeat: usize = arg("--repeat").map_or(Ok(5), |r| r.parse())?;
    let only = arg("--only");
    let plugin = Plugin::discover("xla:cpu").context("loading the XLA CPU plugin")?;
    let client = plugin.client()?;
    let device = client.device(0)?;
    for (name, text, shapes) in programs() {
        if only.as_deref().is_some_and(|o| !name.contains(o)) {
            continue;
        }
        let started = Instant::now();
        let exe = client
            .compile(&text, &CompileOptions::on_device(i64::from(device.id())))
            .with_context(|| format!("compiling {name}:\n{text}"))?;
        let compile = started.elapsed().as_secs_f64();
        let args = shapes
            .iter()
            .map(|dims| {
                let n = dims.iter().product::<i64>() as usize;
                let data = (0..n)
                    .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                    .collect::<Vec<_>>();
                client.buffer_from_slice(&data, dims, &device)
            })
            .collect::<Result<Vec<Buffer>, _>>()?;
        let refs = args.iter().collect::<Vec<_>>();
        let run = || -> Result<f64> {
            let cpu = process_cpu_seconds();
            let out = exe.execute(&refs)?;
            out[0].ready()?;
            Ok(process_cpu_seconds() - cpu)
        };
        run()?;
        let mut times = (0..repeat).map(|_| run()).collect::<Result<Vec<_>>>()?;
        times.sort_by(f64::total_cmp);
        println!(
            "{name:28} cpu ms min {:8.2} median {:8.2}   (compile {:.2} s)",
            times[0] * 1e3,
            times[times.len() / 2] * 1e3,
            compile
        );
    }
    Ok(())
}
