//! TLS material for TCP, WebSocket (wss) and QUIC: certificates from PEM files, or a
//! generated development CA and leaf certificate when none is configured (T6), so the
//! embedded default works out of the box. rustls with the ring provider only, passed
//! explicitly so a second provider in the process can never make the builders panic.

use std::path::Path;
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::error::TransportError;

/// A server's certificate chain and key, plus (for dev certs) the CA that clients trust.
#[derive(Debug)]
pub struct TlsIdentity {
    /// Leaf first.
    pub chain: Vec<CertificateDer<'static>>,
    /// The leaf's private key.
    pub key: PrivateKeyDer<'static>,
    /// PEM of the CA that signed `chain` when it was generated here (None for files).
    pub dev_ca_pem: Option<String>,
}

impl Clone for TlsIdentity {
    fn clone(&self) -> Self {
        Self {
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            dev_ca_pem: self.dev_ca_pem.clone(),
        }
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn config_err(what: impl std::fmt::Display) -> TransportError {
    TransportError::Config(what.to_string())
}

impl TlsIdentity {
    /// Loads a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(cert: &Path, key: &Path) -> Result<Self, TransportError> {
        let chain = CertificateDer::pem_file_iter(cert)
            .map_err(|e| config_err(format!("certificate file {}: {e}", cert.display())))?
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| config_err(format!("certificate file {}: {e}", cert.display())))?;
        if chain.is_empty() {
            return Err(config_err(format!(
                "certificate file {} holds no certificate",
                cert.display()
            )));
        }
        let key = PrivateKeyDer::from_pem_file(key)
            .map_err(|e| config_err(format!("key file {}: {e}", key.display())))?;
        Ok(Self {
            chain,
            key,
            dev_ca_pem: None,
        })
    }

    /// Generates a development CA and a leaf certificate for `names` (DNS names or IP
    /// literals; `localhost`, `127.0.0.1` and `::1` are always included). Clients trust
    /// [`TlsIdentity::dev_ca_pem`]. (Cargo feature `dev-cert`.)
    #[cfg(feature = "dev-cert")]
    pub fn generate_dev(names: &[String]) -> Result<Self, TransportError> {
        use rcgen::{
            BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose,
        };

        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(config_err)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "waygate development CA");
        ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca_key = KeyPair::generate().map_err(config_err)?;
        let ca_cert = ca_params.self_signed(&ca_key).map_err(config_err)?;

        let mut all: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
        for n in names {
            if !all.contains(n) {
                all.push(n.clone());
            }
        }
        let mut leaf_params = CertificateParams::new(all).map_err(config_err)?;
        leaf_params
            .distinguished_name
            .push(DnType::CommonName, "waygate edge (development)");
        leaf_params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        leaf_params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let leaf_key = KeyPair::generate().map_err(config_err)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let leaf = leaf_params
            .signed_by(&leaf_key, &issuer)
            .map_err(config_err)?;

        Ok(Self {
            chain: vec![leaf.der().clone(), ca_cert.der().clone()],
            key: rustls_pki_types::PrivatePkcs8KeyDer::from(leaf_key.serialize_der()).into(),
            dev_ca_pem: Some(ca_cert.pem()),
        })
    }

    /// A rustls server config with this identity and the given ALPN protocols.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Result<rustls::ServerConfig, TransportError> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_no_client_auth()
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(config_err)?;
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

/// What a client trusts.
#[derive(Debug, Clone)]
pub struct ClientTls {
    roots: Arc<rustls::RootCertStore>,
}

impl ClientTls {
    /// Trusts the CA certificates in a PEM string (e.g. [`TlsIdentity::dev_ca_pem`]).
    pub fn from_ca_pem(pem: &str) -> Result<Self, TransportError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
            let cert = cert.map_err(|e| config_err(format!("CA PEM: {e}")))?;
            roots.add(cert).map_err(config_err)?;
        }
        if roots.is_empty() {
            return Err(config_err("CA PEM holds no certificate"));
        }
        Ok(Self {
            roots: Arc::new(roots),
        })
    }

    /// The operating system's trust roots (loaded once per process): what a client trusts
    /// when it was given no CA of its own, so `wss://game.example.com` behind a public CA
    /// works. An error when the system has none (then pass a CA).
    pub fn system_roots() -> Result<Self, TransportError> {
        static ROOTS: std::sync::OnceLock<Result<ClientTls, String>> = std::sync::OnceLock::new();
        ROOTS
            .get_or_init(|| {
                let found = rustls_native_certs::load_native_certs();
                let mut roots = rustls::RootCertStore::empty();
                let (added, _ignored) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    let why = found
                        .errors
                        .first()
                        .map_or_else(|| "none found".to_owned(), ToString::to_string);
                    return Err(format!(
                        "no system trust roots ({why}): pass the CA to trust (ca_pem)"
                    ));
                }
                Ok(ClientTls {
                    roots: Arc::new(roots),
                })
            })
            .clone()
            .map_err(config_err)
    }

    /// Trusts the CA certificates in a PEM file.
    pub fn from_ca_file(path: &Path) -> Result<Self, TransportError> {
        let pem = std::fs::read_to_string(path)
            .map_err(|e| config_err(format!("CA file {}: {e}", path.display())))?;
        Self::from_ca_pem(&pem)
    }

    /// A rustls client config with the given ALPN protocols.
    pub fn client_config(&self, alpn: &[&[u8]]) -> Result<rustls::ClientConfig, TransportError> {
        let mut config = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(config_err)?
            .with_root_certificates(self.roots.clone())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }
}

/// Parses a host (DNS name or IP literal) into a TLS server name.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TransportError> {
    ServerName::try_from(host.to_string())
        .map_err(|e| config_err(format!("server name {host}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_identity_builds_server_and_client_configs() {
        let id = TlsIdentity::generate_dev(&["edge.test".into()]).expect("dev cert");
        assert_eq!(id.chain.len(), 2);
        id.server_config(&[b"x"]).expect("server config");
        let client = ClientTls::from_ca_pem(id.dev_ca_pem.as_deref().expect("ca")).expect("roots");
        client.client_config(&[]).expect("client config");
    }

    #[test]
    fn bad_files_name_the_path() {
        let dir = std::env::temp_dir().join(format!("waygate-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let err = TlsIdentity::from_pem_files(&dir.join("nope.pem"), &dir.join("nope.key"))
            .expect_err("missing file")
            .to_string();
        assert!(err.contains("nope.pem"), "{err}");
        let ca = dir.join("ca.pem");
        let id = TlsIdentity::generate_dev(&[]).expect("dev cert");
        std::fs::write(&ca, id.dev_ca_pem.as_deref().expect("ca")).expect("write");
        ClientTls::from_ca_file(&ca).expect("CA file loads");
        std::fs::write(&ca, "not a pem").expect("write");
        assert!(ClientTls::from_ca_file(&ca).is_err());
    }
}
