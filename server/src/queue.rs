//! The bounded queue between the HTTP handlers and the inference worker. A handler submits a
//! [`Job`] and waits on its [`JobHandle`]; the worker takes [`Batch`]es: the oldest job's
//! [`BatchKey`] decides the batch, and every queued job with the same key gives images to it, up
//! to `max_batch` (a job larger than that is spread over several batches). A handle dropped
//! before its job is done (the client went away) cancels the job.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use oxidiff::pipelines::CancelToken;
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::request::{shutting_down, BatchKey, ImageRequest};

/// One image made, with what its PNG says.
#[derive(Debug, Clone)]
pub struct GeneratedImage {
    /// Which image of its request (0 to count - 1).
    pub index: usize,
    pub seed: u64,
    /// The PNG, with the A1111 `parameters` text chunk `txt2img` writes.
    pub png: Vec<u8>,
    /// That text.
    pub parameters: String,
}

/// What a job tells its handler.
#[derive(Debug, Clone)]
pub enum JobEvent {
    /// A denoising step of a batch holding some of the job's images ended.
    Step {
        step: usize,
        steps: usize,
        /// Of the whole job, 0 to 1.
        progress: f64,
    },
    Image(GeneratedImage),
    Failed(ApiError),
}

/// A request in the queue.
#[derive(Debug)]
pub struct Job {
    pub id: u64,
    pub request: ImageRequest,
    pub key: BatchKey,
    pub cancel: CancelToken,
    pub queued_at: Instant,
    events: mpsc::UnboundedSender<JobEvent>,
}

impl Job {
    /// Sends `event` to the handler (gone handlers are ignored: their jobs are cancelled).
    pub fn send(&self, event: JobEvent) {
        let _ = self.events.send(event);
    }
}

/// What a handler holds while its job runs.
pub struct JobHandle {
    pub job: Arc<Job>,
    events: mpsc::UnboundedReceiver<JobEvent>,
    images: usize,
}

impl JobHandle {
    /// The next event; `None` once every image came (or the worker dropped the job).
    pub async fn next(&mut self) -> Option<JobEvent> {
        if self.images == self.job.request.count {
            return None;
        }
        let event = self.events.recv().await?;
        if let JobEvent::Image(_) = event {
            self.images += 1;
        }
        Some(event)
    }

    /// Every image, in order, or the first failure.
    pub async fn images(&mut self) -> Result<Vec<GeneratedImage>, ApiError> {
        let mut images = Vec::with_capacity(self.job.request.count);
        while let Some(event) = self.next().await {
            match event {
                JobEvent::Image(image) => images.push(image),
                JobEvent::Failed(e) => return Err(e),
                JobEvent::Step { .. } => {}
            }
        }
        if images.len() < self.job.request.count {
            return Err(ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the worker stopped before the images were made",
            ));
        }
        images.sort_by_key(|i| i.index);
        Ok(images)
    }

    fn done(&self) -> bool {
        self.images == self.job.request.count
    }
}

impl Drop for JobHandle {
    fn drop(&mut self) {
        if !self.done() {
            self.job.cancel.cancel();
        }
    }
}

/// Images `first .. first + count` of a job, in one batch.
#[derive(Debug, Clone)]
pub struct Slice {
    pub job: Arc<Job>,
    pub first: usize,
    pub count: usize,
}

/// What one denoiser call makes.
#[derive(Debug, Clone)]
pub struct Batch {
    pub key: BatchKey,
    pub slices: Vec<Slice>,
}

impl Batch {
    pub fn images(&self) -> usize {
        self.slices.iter().map(|s| s.count).sum()
    }
}

struct Entry {
    job: Arc<Job>,
    /// Images already handed to batches.
    next: usize,
}

struct State {
    entries: VecDeque<Entry>,
    closed: bool,
}

/// The queue itself.
pub struct JobQueue {
    state: Mutex<State>,
    changed: Condvar,
    capacity: usize,
    ids: AtomicU64,
}

impl JobQueue {
    /// A queue that holds at most `capacity` waiting requests.
    pub fn new(capacity: usize) -> Self {
        Self {
            state: Mutex::new(State {
                entries: VecDeque::new(),
                closed: false,
            }),
            changed: Condvar::new(),
            capacity,
            ids: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the entries consistent (each change is one
        // push or pop), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `request`; 429 when the queue is full, 503 after [`close`](Self::close).
    pub fn submit(&self, request: ImageRequest) -> Result<JobHandle, ApiError> {
        let (events, receiver) = mpsc::unbounded_channel();
        let job = Arc::new(Job {
            id: self.ids.fetch_add(1, Ordering::Relaxed),
            key: request.batch_key(),
            request,
            cancel: CancelToken::new(),
            queued_at: Instant::now(),
            events,
        });
        let mut state = self.lock();
        if state.closed {
            return Err(shutting_down());
        }
        state.entries.retain(|e| !e.job.cancel.is_cancelled());
        if state.entries.len() >= self.capacity {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the queue is full ({} requests wait): retry later",
                    self.capacity
                ),
            ));
        }
        state.entries.push_back(Entry {
            job: job.clone(),
            next: 0,
        });
        drop(state);
        self.changed.notify_all();
        Ok(JobHandle {
            job,
            events: receiver,
            images: 0,
        })
    }

    /// Requests waiting (not yet wholly handed to a batch).
    pub fn depth(&self) -> usize {
        self.lock().entries.len()
    }

    /// Refuses new requests; the worker still drains the queued ones.
    pub fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Blocks until there is work: the next batch, of at most `max_batch` images, waiting up to
    /// `window` for more requests of its shape when it is not full. `None` once closed and
    /// empty.
    pub fn next_batch(&self, max_batch: usize, window: Duration) -> Option<Batch> {
        let mut state = self.lock();
        let key = loop {
            state.entries.retain(|e| !e.job.cancel.is_cancelled());
            if let Some(first) = state.entries.front() {
                break first.job.key.clone();
            }
            if state.closed {
                return None;
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        };
        let waiting = |state: &State| -> usize {
            state
                .entries
                .iter()
                .filter(|e| e.job.key == key)
                .map(|e| e.job.request.count - e.next)
                .sum()
        };
        let deadline = Instant::now() + window;
        while waiting(&state) < max_batch && !state.closed {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let mut slices = Vec::new();
        let mut room = max_batch;
        for entry in state.entries.iter_mut() {
            if room == 0 {
                break;
            }
            if entry.job.key != key || entry.job.cancel.is_cancelled() {
                continue;
            }
            let count = (entry.job.request.count - entry.next).min(room);
            slices.push(Slice {
                job: entry.job.clone(),
                first: entry.next,
                count,
            });
            entry.next += count;
            room -= count;
        }
        state
            .entries
            .retain(|e| e.next < e.job.request.count && !e.job.cancel.is_cancelled());
        if slices.is_empty() {
            // Every job of the key was cancelled while the window was open: look again.
            drop(state);
            return self.next_batch(max_batch, window);
        }
        Some(Batch { key, slices })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(width: usize, count: usize) -> ImageRequest {
        ImageRequest {
            prompt: "p".into(),
            negative_prompt: String::new(),
            width,
            height: 64,
            steps: 2,
            guidance_scale: 7.5,
            seed: 1,
            count,
            sampler: None,
        }
    }

    #[test]
    fn batches_take_requests_of_one_shape_up_to_the_limit() {
        let queue = JobQueue::new(8);
        let _a = queue.submit(request(64, 3)).unwrap();
        let _b = queue.submit(request(128, 1)).unwrap();
        let _c = queue.submit(request(64, 3)).unwrap();
        let first = queue.next_batch(4, Duration::ZERO).unwrap();
        assert_eq!(first.key.width, 64);
        let spans: Vec<_> = first.slices.iter().map(|s| (s.first, s.count)).collect();
        assert_eq!(spans, [(0, 3), (0, 1)]);
        // The rest of the third request waits behind the other shape, which is now oldest.
        let second = queue.next_batch(4, Duration::ZERO).unwrap();
        assert_eq!(second.key.width, 128);
        let third = queue.next_batch(4, Duration::ZERO).unwrap();
        let spans: Vec<_> = third.slices.iter().map(|s| (s.first, s.count)).collect();
        assert_eq!(spans, [(1, 2)]);
        assert_eq!(queue.depth(), 0);
    }

    #[test]
    fn a_full_queue_refuses_and_a_dropped_handle_leaves_it() {
        let queue = JobQueue::new(2);
        let a = queue.submit(request(64, 1)).unwrap();
        let _b = queue.submit(request(64, 1)).unwrap();
        let refused = queue.submit(request(64, 1)).err().unwrap();
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        drop(a);
        let _c = queue.submit(request(64, 1)).unwrap();
        assert_eq!(queue.depth(), 2);
        queue.close();
        let closed = queue.submit(request(64, 1)).err().unwrap();
        assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
        // Closed, the queue still drains what it holds.
        assert_eq!(queue.next_batch(4, Duration::ZERO).unwrap().images(), 2);
        assert!(queue.next_batch(4, Duration::ZERO).is_none());
    }
}
