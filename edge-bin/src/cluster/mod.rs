//! The distributed control plane (SPEC R9, R10, S7): etcd for routes and registrations.

pub mod etcd;
