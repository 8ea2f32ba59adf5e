//! pipelines (in progress)
