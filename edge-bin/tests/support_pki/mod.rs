//! Test harness: a private CA in a temporary directory that issues certificates as PEM
//! files (for servers the tests start with TLS: etcd, Redis). Never trusted by the system.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};

/// A CA whose certificate is `ca.pem` in its directory.
pub struct TestCa {
    dir: tempfile::TempDir,
    issuer: Issuer<'static, KeyPair>,
    /// The CA certificate, PEM.
    pub pem: String,
}

impl TestCa {
    /// A new CA; its certificate is written to `ca.pem`.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // Names of its own: a leaf with the issuer's subject looks self-issued to OpenSSL
        // (redis-server and its sentinels as TLS clients refuse it).
        ca.distinguished_name
            .push(DnType::CommonName, "waygate test CA");
        let key = KeyPair::generate().expect("key");
        let pem = ca.self_signed(&key).expect("self-signed").pem();
        std::fs::write(dir.path().join("ca.pem"), &pem).expect("write ca.pem");
        Self {
            dir,
            issuer: Issuer::new(ca, key),
            pem,
        }
    }

    /// A file in the CA's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Issues a certificate for `names` (DNS names or IP addresses), written as
    /// `NAME.pem` and `NAME.key`; returns their paths.
    pub fn issue(&self, names: &[&str], name: &str) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().expect("key");
        let mut params =
            CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
                .expect("params");
        params.distinguished_name.push(DnType::CommonName, name);
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        let (cert_path, key_path) = (
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}.key")),
        );
        std::fs::write(&cert_path, cert.pem()).expect("write certificate");
        std::fs::write(&key_path, key.serialize_pem()).expect("write key");
        (cert_path, key_path)
    }
}
