//! The inference worker: one thread that owns the loaded pipeline (it is loaded there, so a
//! backend's device state never crosses threads) and runs the queue's batches one after
//! another, off the async runtime. Each image of a batch is drawn from its own seed's
//! generator, as `txt2img --batch-size` does, so it equals the image `txt2img` makes alone with
//! the same parameters.

use std::path::Path;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use oxidiff::cli::model_lookup::png_model_hash;
use oxidiff::cli::{closing_fields, model_name, run_defaults, Precision};
use oxidiff::execution::{Execution, PipelineBackend};
use oxidiff::pipelines::metadata::{encode_png, sampler_field, PARAMETERS_KEYWORD};
use oxidiff::pipelines::resolve_model;
use oxidiff::pipelines::{
    is_single_file, AutoPipeline, CancelToken, FamilyOptions, GenerateRequest,
    GenerationParameters, LoadOptions, OutputType, PipelineError, SingleFileOptions, StepInfo,
};
use oxidiff::schedulers::TorchCpuGenerators;
use oxidiff::{Cpu, Oxi, OxiDevice};

use crate::error::{ApiError, ServerError};
use crate::metrics::Metrics;
use crate::queue::{Batch, GeneratedImage, JobEvent, JobQueue};
use crate::request::{Limits, ModelInfo};

/// What the worker loads and how it runs it.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// A diffusers folder, a Hub id in the local cache, or a single `.safetensors` file.
    pub model: String,
    pub device: OxiDevice,
    pub execution: Execution,
    pub dtype: Precision,
    pub variant: Option<String>,
    /// The sampler of requests that name none; `None`: the checkpoint's.
    pub scheduler: Option<String>,
    /// Run every batch size once at the default size before serving, so that compiled mode
    /// never compiles while a client waits.
    pub warm_up: bool,
    /// What the pipeline hands back between requests (`--offload`).
    pub offload: oxidiff::pipelines::Offload,
}

/// The batch that runs now, for A1111's `/progress` and `/interrupt`.
#[derive(Default)]
pub struct Status {
    current: Mutex<Option<Running>>,
}

#[derive(Clone)]
struct Running {
    step: usize,
    steps: usize,
    images: usize,
    started: Instant,
    cancel: CancelToken,
    interrupted: bool,
}

/// What `/sdapi/v1/progress` reports of the running batch.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    pub step: usize,
    pub steps: usize,
    pub images: usize,
    pub elapsed: Duration,
}

impl Status {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Running>> {
        self.current.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn snapshot(&self) -> Option<Snapshot> {
        self.lock().as_ref().map(|r| Snapshot {
            step: r.step,
            steps: r.steps,
            images: r.images,
            elapsed: r.started.elapsed(),
        })
    }

    /// Stops the running batch after its current step (A1111's interrupt); whether one ran.
    pub fn interrupt(&self) -> bool {
        match self.lock().as_mut() {
            Some(running) => {
                running.interrupted = true;
                running.cancel.cancel();
                true
            }
            None => false,
        }
    }

    fn begin(&self, steps: usize, images: usize, cancel: CancelToken) {
        *self.lock() = Some(Running {
            step: 0,
            steps,
            images,
            started: Instant::now(),
            cancel,
            interrupted: false,
        });
    }

    fn step(&self, step: usize) {
        if let Some(running) = self.lock().as_mut() {
            running.step = step;
        }
    }

    /// Ends the batch; whether it was interrupted.
    fn end(&self) -> bool {
        self.lock().take().is_some_and(|r| r.interrupted)
    }
}

/// Starts the worker thread: it loads the model, warms it up, reports the model, then serves
/// `queue` until it is closed and drained. A model that does not load is the error.
pub fn spawn(
    config: WorkerConfig,
    limits: Limits,
    queue: Arc<JobQueue>,
    metrics: Arc<Metrics>,
    status: Arc<Status>,
) -> Result<(ModelInfo, JoinHandle<()>), ServerError> {
    let (ready, loaded) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name("oxidiff-worker".into())
        .spawn(move || {
            let context = Context {
                limits,
                queue,
                metrics,
                status,
            };
            match config.device.clone() {
                OxiDevice::Cpu => serve::<Cpu>(&config, &Default::default(), context, ready),
                device => serve::<Oxi>(&config, &device, context, ready),
            }
        })?;
    match loaded.recv() {
        Ok(Ok(info)) => Ok((info, thread)),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(e)
        }
        Err(_) => {
            let _ = thread.join();
            Err(ServerError::Worker(
                "it stopped while loading the model".into(),
            ))
        }
    }
}

/// What the worker shares with the handlers.
struct Context {
    limits: Limits,
    queue: Arc<JobQueue>,
    metrics: Arc<Metrics>,
    status: Arc<Status>,
}

fn serve<B: PipelineBackend>(
    config: &WorkerConfig,
    device: &B::Device,
    context: Context,
    ready: mpsc::Sender<Result<ModelInfo, ServerError>>,
) {
    let mut worker = match Worker::<B>::load(config, device, &context) {
        Ok(worker) => worker,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(worker.info.clone()));
    while let Some(batch) = context
        .queue
        .next_batch(context.limits.max_batch, context.limits.batch_window)
    {
        worker.run(batch, &context);
    }
}

struct Worker<B: PipelineBackend> {
    pipe: AutoPipeline<B>,
    info: ModelInfo,
    /// The sampler the pipeline's scheduler is set to.
    sampler: Option<String>,
}

impl<B: PipelineBackend> Worker<B> {
    fn load(
        config: &WorkerConfig,
        device: &B::Device,
        context: &Context,
    ) -> Result<Self, ServerError> {
        let loading = |source| ServerError::Load {
            model: config.model.clone(),
            source: Box::new(source),
        };
        let options = LoadOptions {
            variant: config.variant.clone(),
            // Loaded with the checkpoint's scheduler: each sampler is switched from it.
            scheduler: None,
            dtype: config.dtype.load_dtype(),
            transformer: None,
        };
        let path = Path::new(&config.model);
        let hash_options = options.clone();
        let mut pipe = B::load(device, config.execution, || {
            if is_single_file(path) {
                let single = SingleFileOptions {
                    load: options,
                    config: None,
                    tokenizer: None,
                    prediction_type: None,
                };
                AutoPipeline::<B>::from_single_file(path, &single, device)
            } else {
                AutoPipeline::<B>::from_pretrained(&config.model, &options, device)
            }
        })
        .map_err(loading)?;
        pipe.set_offload(config.offload);
        // The PNGs' `Model hash` (as txt2img's): the single file, or the resolved folder's
        // denoiser (resolved again after the load: a
        // Hub id is in the cache by then); a model that cannot be hashed gets none.
        let hashed = if is_single_file(path) {
            Ok(path.to_path_buf())
        } else {
            resolve_model(&config.model, config.variant.as_deref())
        };
        let hash = hashed
            .and_then(|model| png_model_hash(&model, &hash_options))
            .unwrap_or_else(|e| {
                tracing::warn!("the PNGs get no Model hash: {e}");
                String::new()
            });
        B::prepare(&mut pipe, config.execution).map_err(loading)?;
        let (default_steps, default_guidance) = run_defaults(&config.model, &pipe.defaults());
        let info = ModelInfo {
            name: model_name(&config.model),
            hash,
            class: format!("{:?}", pipe.family()),
            default_size: pipe.default_size(),
            size_multiple: pipe.vae_scale_factor(),
            default_steps,
            default_guidance,
            default_sampler: config.scheduler.clone(),
            scheduler_config: pipe.scheduler_config().clone(),
            device: config.device.to_string(),
            dtype: config.dtype.name().into(),
        };
        // Checked here so that a bad --scheduler stops the start, not every request.
        let scheduler = info
            .sampler_config(None)
            .map_err(|e| ServerError::Scheduler(e.message))?;
        pipe.set_scheduler_config(scheduler).map_err(loading)?;
        let mut worker = Self {
            pipe,
            sampler: config.scheduler.clone(),
            info,
        };
        if config.warm_up {
            worker.warm_up(context)?;
        }
        Ok(worker)
    }

    /// One generation of every batch size at the default size and guidance, so that the
    /// programs a request needs exist before the first one comes. Eager mode's per-op
    /// executables need one step; compiled mode runs the default step count, for the scheduler
    /// step's programs (one per step structure, which the step count decides: a multistep
    /// scheduler's first, middle and last steps differ).
    fn warm_up(&mut self, context: &Context) -> Result<(), ServerError> {
        let size = self.info.default_size;
        let steps = match B::compile_stats(&self.pipe) {
            Some(_) => self.info.default_steps,
            None => 1,
        };
        for images in 1..=context.limits.max_batch {
            let request = GenerateRequest {
                prompts: vec![String::new(); images],
                num_inference_steps: steps,
                guidance_scale: self.info.default_guidance,
                width: Some(size),
                height: Some(size),
                ..Default::default()
            };
            let seeds: Vec<u64> = (0..images as u64).collect();
            let mut noise = TorchCpuGenerators::new(&seeds);
            self.pipe
                .generate_with(&request, &FamilyOptions::default(), &mut noise, |_| {})
                .map_err(|source| ServerError::WarmUp {
                    images,
                    source: Box::new(source),
                })?;
            tracing::info!(images, mode = %B::mode(&self.pipe), "warmed up");
        }
        context.metrics.compile_stats(B::compile_stats(&self.pipe));
        Ok(())
    }

    fn run(&mut self, batch: Batch, context: &Context) {
        let started = Instant::now();
        let size = batch.images();
        let result = self.generate(&batch, context);
        let interrupted = context.status.end();
        // Counted before the answers go out, so that a client reading /metrics after its
        // answer sees its batch.
        let abandoned: usize = batch
            .slices
            .iter()
            .filter(|s| s.job.cancel.is_cancelled())
            .map(|s| s.count)
            .sum();
        let delivered = if result.is_ok() { size - abandoned } else { 0 };
        context
            .metrics
            .batch(size, delivered, abandoned, started.elapsed());
        context.metrics.compile_stats(B::compile_stats(&self.pipe));
        match result {
            Ok(images) => {
                let owners = batch
                    .slices
                    .iter()
                    .flat_map(|s| std::iter::repeat_n(s, s.count));
                for (slice, image) in owners.zip(images) {
                    slice.job.send(JobEvent::Image(image));
                }
            }
            Err(e) => {
                let error = match e {
                    PipelineError::Cancelled { done, total } if interrupted => ApiError::new(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("interrupted (/sdapi/v1/interrupt) after {done} of {total} steps"),
                    ),
                    PipelineError::InvalidInput(message) => {
                        ApiError::new(StatusCode::BAD_REQUEST, message)
                    }
                    other => ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        format!("generation failed: {other}"),
                    ),
                };
                for slice in &batch.slices {
                    slice.job.send(JobEvent::Failed(error.clone()));
                }
            }
        }
    }

    /// The batch's images, in slice order.
    fn generate(
        &mut self,
        batch: &Batch,
        context: &Context,
    ) -> Result<Vec<GeneratedImage>, PipelineError> {
        let key = &batch.key;
        if self.sampler != key.sampler {
            let config = self
                .info
                .sampler_config(key.sampler.as_deref())
                .map_err(|e| PipelineError::InvalidInput(e.message))?;
            self.pipe.set_scheduler_config(config)?;
            self.sampler = key.sampler.clone();
        }
        let mut prompts = Vec::new();
        let mut negatives = Vec::new();
        let mut seeds = Vec::new();
        let mut indices = Vec::new();
        for slice in &batch.slices {
            let request = &slice.job.request;
            for index in slice.first..slice.first + slice.count {
                prompts.push(request.prompt.clone());
                negatives.push(request.negative_prompt.clone());
                seeds.push(request.seed + index as u64);
                indices.push(index);
            }
        }
        let cancel = CancelToken::new();
        context
            .status
            .begin(key.steps, prompts.len(), cancel.clone());
        let request = GenerateRequest {
            prompts: prompts.clone(),
            negative_prompts: if key.negative_given {
                negatives.clone()
            } else {
                Vec::new()
            },
            num_inference_steps: key.steps,
            guidance_scale: key.guidance_scale,
            width: Some(key.width),
            height: Some(key.height),
            num_images_per_prompt: 1,
            seed: seeds[0],
            output: OutputType::Images,
            cancel: Some(cancel.clone()),
            ..Default::default()
        };
        let mut noise = TorchCpuGenerators::new(&seeds);
        let mut last = Instant::now();
        let on_step = |info: StepInfo<'_, B>| {
            context.metrics.step(last.elapsed());
            last = Instant::now();
            let step = info.step + 1;
            context.status.step(step);
            let fraction = step as f64 / info.num_steps as f64;
            for slice in &batch.slices {
                let count = slice.job.request.count as f64;
                slice.job.send(JobEvent::Step {
                    step,
                    steps: info.num_steps,
                    progress: (slice.first as f64 + slice.count as f64 * fraction) / count,
                });
            }
            // Nobody waits for these images any more: stop after this step.
            if batch.slices.iter().all(|s| s.job.cancel.is_cancelled()) {
                cancel.cancel();
            }
        };
        let output =
            self.pipe
                .generate_with(&request, &FamilyOptions::default(), &mut noise, on_step)?;
        let images = output
            .images
            .ok_or_else(|| PipelineError::InvalidInput("the pipeline returned no images".into()))?;
        let sampler = sampler_field(key.sampler.as_deref(), self.pipe.scheduler().kind());
        let mut made = Vec::with_capacity(prompts.len());
        for (j, ((prompt, negative), seed)) in
            prompts.into_iter().zip(negatives).zip(seeds).enumerate()
        {
            let parameters = GenerationParameters {
                prompt,
                negative_prompt: negative,
                steps: key.steps,
                sampler: sampler.clone(),
                guidance_scale: key.guidance_scale,
                seed,
                width: images.width,
                height: images.height,
                model: self.info.name.clone(),
                model_hash: self.info.hash.clone(),
                extra: closing_fields(&[]),
            }
            .to_text();
            let rgb = images.to_rgb8(j).ok_or_else(|| {
                PipelineError::InvalidInput("the pipeline returned too few images".into())
            })?;
            let png = encode_png(&rgb, &[(PARAMETERS_KEYWORD, parameters.clone())])?;
            made.push(GeneratedImage {
                index: indices[j],
                seed,
                png,
                parameters,
            });
        }
        Ok(made)
    }
}
