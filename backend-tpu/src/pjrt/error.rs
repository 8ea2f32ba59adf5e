//! Errors of the PJRT runtime layer: every failing PJRT call becomes an
//! [`Error::Pjrt`] carrying the C function's name, the plugin's status code and
//! its message; the other variants say what the Rust side found wrong.

use std::fmt;
use std::path::PathBuf;

/// Result of the PJRT runtime layer.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A PJRT status code (`PJRT_Error_Code`, the absl status codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    Cancelled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
    /// A code this crate does not know (or 0, "OK", on a non-null error).
    Other(i32),
}

impl ErrorCode {
    /// The code for the C enum's value.
    pub fn from_raw(code: i32) -> Self {
        match code {
            1 => Self::Cancelled,
            2 => Self::Unknown,
            3 => Self::InvalidArgument,
            4 => Self::DeadlineExceeded,
            5 => Self::NotFound,
            6 => Self::AlreadyExists,
            7 => Self::PermissionDenied,
            8 => Self::ResourceExhausted,
            9 => Self::FailedPrecondition,
            10 => Self::Aborted,
            11 => Self::OutOfRange,
            12 => Self::Unimplemented,
            13 => Self::Internal,
            14 => Self::Unavailable,
            15 => Self::DataLoss,
            16 => Self::Unauthenticated,
            other => Self::Other(other),
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::Cancelled => "CANCELLED",
            Self::Unknown => "UNKNOWN",
            Self::InvalidArgument => "INVALID_ARGUMENT",
            Self::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Self::NotFound => "NOT_FOUND",
            Self::AlreadyExists => "ALREADY_EXISTS",
            Self::PermissionDenied => "PERMISSION_DENIED",
            Self::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Self::FailedPrecondition => "FAILED_PRECONDITION",
            Self::Aborted => "ABORTED",
            Self::OutOfRange => "OUT_OF_RANGE",
            Self::Unimplemented => "UNIMPLEMENTED",
            Self::Internal => "INTERNAL",
            Self::Unavailable => "UNAVAILABLE",
            Self::DataLoss => "DATA_LOSS",
            Self::Unauthenticated => "UNAUTHENTICATED",
            Self::Other(code) => return write!(f, "code {code}"),
        };
        f.write_str(name)
    }
}

/// Everything that can go wrong between oxidiff and a PJRT plugin.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A PJRT C API function returned an error.
    #[error("{function} failed ({code}): {message}")]
    Pjrt {
        function: &'static str,
        code: ErrorCode,
        message: String,
    },

    /// The plugin file does not exist or the dynamic loader rejected it.
    #[error("cannot load PJRT plugin {path}: {reason}")]
    Load { path: PathBuf, reason: String },

    /// The file loaded but is not a PJRT plugin.
    #[error("{path} is not a PJRT plugin: {reason}")]
    NotAPlugin { path: PathBuf, reason: String },

    /// The plugin speaks a PJRT C API version this crate cannot use.
    #[error(
        "PJRT plugin {path} implements C API {major}.{minor}; oxidiff needs 0.{min_minor} or a later 0.x"
    )]
    UnsupportedApiVersion {
        path: PathBuf,
        major: i32,
        minor: i32,
        min_minor: i32,
    },

    /// The plugin's function table is too short for, or has a null, function.
    #[error(
        "PJRT plugin {path} (C API {api_version}) does not provide {function}: {reason}; use a newer plugin"
    )]
    MissingFunction {
        path: PathBuf,
        api_version: String,
        function: &'static str,
        reason: String,
    },

    /// No plugin for the asked-for name was found.
    #[error("no PJRT plugin for `{name}` found. Looked in:\n{}\n{install}", searched.iter().map(|s| format!("  - {s}")).collect::<Vec<_>>().join("\n"))]
    PluginNotFound {
        name: String,
        searched: Vec<String>,
        install: String,
    },

    /// A name that is neither a known plugin nor a path.
    #[error("unknown PJRT plugin name `{0}`: use xla:cpu, tpu, cuda or a path to a plugin .so")]
    UnknownPluginName(String),

    /// The client's platform is not the one the plugin was loaded for.
    #[error(
        "PJRT plugin {path} was loaded as `{expected}` but its client reports platform `{found}`"
    )]
    PlatformMismatch {
        path: PathBuf,
        expected: String,
        found: String,
    },

    /// libtpu found no TPU.
    #[error("no TPU found on this machine ({detail}); libtpu can still compile ahead of time for a TPU topology with `Topology`")]
    NoTpu { detail: String },

    /// A device index beyond the client's addressable devices.
    #[error("device index {index} out of range: the {platform} client has {count} addressable device(s)")]
    DeviceIndexOutOfRange {
        index: usize,
        count: usize,
        platform: String,
    },

    /// An object of one client was handed to another client.
    #[error("{what} belongs to a different PJRT client")]
    ForeignObject { what: &'static str },

    /// A PJRT element type this crate does not handle.
    #[error("unsupported PJRT element type {0}")]
    UnsupportedElementType(i32),

    /// Host data and shape disagree, or a similar caller mistake.
    #[error("{0}")]
    InvalidArgument(String),
}
