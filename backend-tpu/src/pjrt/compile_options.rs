//! `xla.CompileOptionsProto`, the serialized options every PJRT compile call
//! takes, reduced to the fields oxidiff sets.
//!
//! Field numbers follow `xla/pjrt/proto/compile_options.proto`
//! (`CompileOptionsProto`, `ExecutableBuildOptionsProto`) and
//! `xla/xla_data.proto` (`DeviceAssignmentProto`). Unknown fields are simply
//! absent, which protobuf reads as their defaults.

use prost::Message;

/// The raw protobuf messages.
pub mod proto {
    /// `xla.CompileOptionsProto` (subset).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct CompileOptionsProto {
        #[prost(message, optional, tag = "3")]
        pub executable_build_options: Option<ExecutableBuildOptionsProto>,
    }

    /// `xla.ExecutableBuildOptionsProto` (subset).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ExecutableBuildOptionsProto {
        /// -1: not set (compile for any device).
        #[prost(int64, tag = "1")]
        pub device_ordinal: i64,
        #[prost(int64, tag = "4")]
        pub num_replicas: i64,
        #[prost(int64, tag = "5")]
        pub num_partitions: i64,
        #[prost(bool, tag = "6")]
        pub use_spmd_partitioning: bool,
        #[prost(message, optional, tag = "9")]
        pub device_assignment: Option<DeviceAssignmentProto>,
        #[prost(bool, tag = "19")]
        pub use_shardy_partitioner: bool,
    }

    /// `xla.DeviceAssignmentProto`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct DeviceAssignmentProto {
        #[prost(int32, tag = "1")]
        pub replica_count: i32,
        #[prost(int32, tag = "2")]
        pub computation_count: i32,
        /// One entry per computation (partition).
        #[prost(message, repeated, tag = "3")]
        pub computation_devices: Vec<ComputationDevice>,
    }

    /// `xla.DeviceAssignmentProto.ComputationDevice`.
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ComputationDevice {
        /// The device id of each replica of this computation.
        #[prost(int64, repeated, tag = "1")]
        pub replica_device_ids: Vec<i64>,
    }
}

/// How to compile a program: replicas, partitions and which devices run them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompileOptions {
    pub num_replicas: i64,
    pub num_partitions: i64,
    /// GSPMD partitioning of a program annotated with `mhlo.sharding`.
    pub use_spmd_partitioning: bool,
    /// Shardy partitioning of a program annotated with `sdy.sharding`.
    pub use_shardy_partitioner: bool,
    /// `device_assignment[partition][replica]` = device id; `None` lets the
    /// plugin choose (device 0 for one device).
    pub device_assignment: Option<Vec<Vec<i64>>>,
}

impl Default for CompileOptions {
    fn default() -> Self {
        Self {
            num_replicas: 1,
            num_partitions: 1,
            use_spmd_partitioning: false,
            use_shardy_partitioner: false,
            device_assignment: None,
        }
    }
}

impl CompileOptions {
    /// One replica, one partition, on the device with id `device_id`.
    pub fn on_device(device_id: i64) -> Self {
        Self {
            device_assignment: Some(vec![vec![device_id]]),
            ..Self::default()
        }
    }

    /// GSPMD over `device_ids.len()` partitions, one per listed device.
    pub fn spmd(device_ids: &[i64]) -> Self {
        Self {
            num_partitions: device_ids.len() as i64,
            use_spmd_partitioning: true,
            device_assignment: Some(device_ids.iter().map(|&id| vec![id]).collect()),
            ..Self::default()
        }
    }

    /// The protobuf message.
    pub fn to_proto(&self) -> proto::CompileOptionsProto {
        let device_assignment =
            self.device_assignment
                .as_ref()
                .map(|partitions| proto::DeviceAssignmentProto {
                    replica_count: self.num_replicas as i32,
                    computation_count: partitions.len() as i32,
                    computation_devices: partitions
                        .iter()
                        .map(|replicas| proto::ComputationDevice {
                            replica_device_ids: replicas.clone(),
                        })
                        .collect(),
                });
        proto::CompileOptionsProto {
            executable_build_options: Some(proto::ExecutableBuildOptionsProto {
                device_ordinal: -1,
                num_replicas: self.num_replicas,
                num_partitions: self.num_partitions,
                use_spmd_partitioning: self.use_spmd_partitioning,
                device_assignment,
                use_shardy_partitioner: self.use_shardy_partitioner,
            }),
        }
    }

    /// The serialized `CompileOptionsProto`.
    pub fn encode(&self) -> Vec<u8> {
        self.to_proto().encode_to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Wire bytes checked by hand against the .proto field numbers:
    /// field 3 (len) { field 1 = -1, 4 = 1, 5 = 2, 6 = true, 9 (len) {...} }.
    #[test]
    fn spmd_options_encode_with_the_xla_field_numbers() {
        let bytes = CompileOptions::spmd(&[0, 1]).encode();
        // Outer: tag (3 << 3 | 2) = 0x1a.
        assert_eq!(bytes[0], 0x1a);
        let inner = &bytes[2..];
        assert_eq!(bytes[1] as usize, inner.len());
        // device_ordinal = -1: tag 0x08, ten-byte varint of 2^64 - 1.
        assert_eq!(
            &inner[..11],
            &[0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        // num_replicas = 1 (0x20), num_partitions = 2 (0x28), spmd = true (0x30).
        assert_eq!(&inner[11..17], &[0x20, 0x01, 0x28, 0x02, 0x30, 0x01]);
        // device_assignment: tag (9 << 3 | 2) = 0x4a, then replica_count 1,
        // computation_count 2, two ComputationDevice {1: [id]} (packed).
        assert_eq!(
            &inner[17..],
            &[
                0x4a, 0x0e, 0x08, 0x01, 0x10, 0x02, 0x1a, 0x03, 0x0a, 0x01, 0x00, 0x1a, 0x03, 0x0a,
                0x01, 0x01
            ]
        );
        let decoded = proto::CompileOptionsProto::decode(bytes.as_slice()).ok();
        assert_eq!(decoded, Some(CompileOptions::spmd(&[0, 1]).to_proto()));
    }

    #[test]
    fn shardy_flag_is_field_19() {
        let options = CompileOptions {
            use_shardy_partitioner: true,
            ..CompileOptions::default()
        };
        let bytes = options.encode();
        // Tag (19 << 3 | 0) = 152 = varint [0x98, 0x01], value 1.
        assert!(bytes.windows(3).any(|w| w == [0x98, 0x01, 0x01]));
    }
}
