//! Cluster security: a cluster CA, one certificate per proc signed by it, and
//! the rustls configurations for mutual TLS. `rdma/` reuses these for its
//! authenticated TCP path.
//!
//! A proc's certificate names the proc as its DNS subject alternative name,
//! so a dialer's TLS check of the server name is the check that it reached
//! the proc it meant to, and a listener checks a dialer's claimed proc with
//! [`verify_proc_identity`]. Only TLS 1.3 and the ring provider are used.
//! Private keys are never printed: the `Debug` forms leave them out.

use std::fmt;
use std::fs;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use rustls::RootCertStore;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, DnsName, PrivateKeyDer, ServerName};

use crate::error::Error;
use crate::id::ProcId;

/// The ALPN protocol name of regent's control plane.
pub const ALPN: &[u8] = b"regent/1";

fn tls(context: &'static str) -> impl FnOnce(rustls::Error) -> Error {
    move |e| Error::Tls {
        context,
        reason: e.to_string(),
    }
}

fn cert_err(context: &'static str) -> impl FnOnce(rcgen::Error) -> Error {
    move |e| Error::Certificate {
        context,
        reason: e.to_string(),
    }
}

/// The crypto provider of every config made here (ring).
pub fn crypto_provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificate authority of one cluster. The controller makes it (or
/// loads it) and issues a certificate to each proc.
pub struct ClusterCa {
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClusterCa")
            .field("cert_der_bytes", &self.cert_der.len())
            .finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// Makes a new CA (ECDSA P-256) whose subject is `CN=<name>`.
    pub fn generate(name: &str) -> Result<Self, Error> {
        let key = KeyPair::generate().map_err(cert_err("generate CA key"))?;
        let mut params =
            CertificateParams::new(Vec::<String>::new()).map_err(cert_err("CA parameters"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).map_err(cert_err("self-sign CA"))?;
        Ok(Self {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        })
    }

    /// Loads a CA from its certificate and private key in PEM.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self, Error> {
        let key = KeyPair::from_pem(key_pem).map_err(cert_err("parse CA key"))?;
        let cert_der = CertificateDer::from_pem_slice(cert_pem.as_bytes()).map_err(|e| {
            Error::Certificate {
                context: "parse CA certificate",
                reason: e.to_string(),
            }
        })?;
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(cert_err("load CA issuer"))?;
        Ok(Self {
            cert_der,
            cert_pem: cert_pem.to_owned(),
            issuer,
        })
    }

    /// Writes `ca.crt` and `ca.key` (mode 0600) into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), Error> {
        write_file(&dir.join("ca.crt"), self.cert_pem.as_bytes(), 0o644)?;
        write_file(
            &dir.join("ca.key"),
            self.issuer.key().serialize_pem().as_bytes(),
            0o600,
        )
    }

    /// Loads what [`Self::save`] wrote.
    pub fn load(dir: &Path) -> Result<Self, Error> {
        Self::from_pem(
            &read_file(&dir.join("ca.crt"))?,
            &read_file(&dir.join("ca.key"))?,
        )
    }

    /// The CA certificate in DER.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// The CA certificate in PEM.
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// Issues the certificate of `proc` (a fresh ECDSA P-256 key; the proc id
    /// as DNS name; usable as TLS client and server).
    pub fn issue(&self, proc: &ProcId) -> Result<ProcCredentials, Error> {
        let key = KeyPair::generate().map_err(cert_err("generate proc key"))?;
        let mut params = CertificateParams::new(vec![proc.as_str().to_owned()])
            .map_err(cert_err("proc certificate parameters"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, proc.as_str());
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(cert_err("sign proc certificate"))?;
        Ok(ProcCredentials {
            proc: proc.clone(),
            chain: vec![cert.der().clone()],
            key: PrivateKeyDer::try_from(key.serialize_der()).map_err(|e| Error::Certificate {
                context: "proc key",
                reason: e.to_owned(),
            })?,
            ca: self.cert_der.clone(),
        })
    }
}

/// A proc's identity: its certificate chain and private key, and the
/// cluster CA it trusts.
pub struct ProcCredentials {
    proc: ProcId,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    ca: CertificateDer<'static>,
}

impl Clone for ProcCredentials {
    fn clone(&self) -> Self {
        Self {
            proc: self.proc.clone(),
            chain: self.chain.clone(),
            key: self.key.clone_key(),
            ca: self.ca.clone(),
        }
    }
}

impl fmt::Debug for ProcCredentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProcCredentials")
            .field("proc", &self.proc)
            .field("chain_len", &self.chain.len())
            .finish_non_exhaustive()
    }
}

impl ProcCredentials {
    /// Loads credentials from PEM: the certificate chain (leaf first), the
    /// private key and the CA certificate. The leaf must name `proc`.
    pub fn from_pem(
        proc: ProcId,
        chain_pem: &str,
        key_pem: &str,
        ca_pem: &str,
    ) -> Result<Self, Error> {
        let creds = Self::danger_unchecked_from_pem(proc, chain_pem, key_pem, ca_pem)?;
        verify_proc_identity(&creds.chain, &creds.proc)?;
        Ok(creds)
    }

    /// Loads credentials like [`Self::from_pem`] without checking that the
    /// certificate names `proc`: for tests that play a proc lying about its
    /// identity. Peers refuse such a proc.
    pub fn danger_unchecked_from_pem(
        proc: ProcId,
        chain_pem: &str,
        key_pem: &str,
        ca_pem: &str,
    ) -> Result<Self, Error> {
        let pem_err = |context: &'static str| {
            move |e: rustls_pki_types::pem::Error| Error::Certificate {
                context,
                reason: e.to_string(),
            }
        };
        let chain = CertificateDer::pem_slice_iter(chain_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(pem_err("parse certificate chain"))?;
        if chain.is_empty() {
            return Err(Error::Certificate {
                context: "parse certificate chain",
                reason: "no certificate in the PEM".into(),
            });
        }
        let key =
            PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(pem_err("parse key"))?;
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(pem_err("parse CA"))?;
        Ok(Self {
            proc,
            chain,
            key,
            ca,
        })
    }

    /// The proc these credentials are for.
    pub fn proc(&self) -> &ProcId {
        &self.proc
    }

    /// The certificate chain, leaf first.
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    /// The trusted cluster CA.
    pub fn ca(&self) -> &CertificateDer<'static> {
        &self.ca
    }

    /// The PEM forms: (certificate chain, private key, CA certificate).
    /// The key is secret: do not log it.
    pub fn to_pem(&self) -> (String, String, String) {
        let chain = self.chain.iter().map(|c| pem("CERTIFICATE", c)).collect();
        let key = pem("PRIVATE KEY", self.key.secret_der());
        (chain, key, pem("CERTIFICATE", &self.ca))
    }

    /// Writes `<proc>.crt`, `<proc>.key` (mode 0600) and `ca.crt` into `dir`.
    pub fn save(&self, dir: &Path) -> Result<(), Error> {
        let (chain, key, ca) = self.to_pem();
        write_file(
            &dir.join(format!("{}.crt", self.proc)),
            chain.as_bytes(),
            0o644,
        )?;
        write_file(
            &dir.join(format!("{}.key", self.proc)),
            key.as_bytes(),
            0o600,
        )?;
        write_file(&dir.join("ca.crt"), ca.as_bytes(), 0o644)
    }

    /// Loads what [`Self::save`] wrote for `proc`.
    pub fn load(dir: &Path, proc: ProcId) -> Result<Self, Error> {
        let chain = read_file(&dir.join(format!("{proc}.crt")))?;
        let key = read_file(&dir.join(format!("{proc}.key")))?;
        let ca = read_file(&dir.join("ca.crt"))?;
        Self::from_pem(proc, &chain, &key, &ca)
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, Error> {
        let mut roots = RootCertStore::empty();
        roots
            .add(self.ca.clone())
            .map_err(tls("trust the cluster CA"))?;
        Ok(Arc::new(roots))
    }

    /// A TLS 1.3 server config that requires a client certificate from the
    /// cluster CA. The caller checks the client's claimed proc with
    /// [`verify_proc_identity`].
    pub fn server_config(&self) -> Result<rustls::ServerConfig, Error> {
        let provider = crypto_provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .build()
            .map_err(|e| Error::Tls {
                context: "client verifier",
                reason: e.to_string(),
            })?;
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls("server protocol versions"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls("server certificate"))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// A TLS 1.3 client config that trusts only the cluster CA and presents
    /// this proc's certificate. Connect with the peer's proc id as server
    /// name ([`server_name`]).
    pub fn client_config(&self) -> Result<rustls::ClientConfig, Error> {
        let mut config = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(tls("client protocol versions"))?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(tls("client certificate"))?;
        config.alpn_protocols = vec![ALPN.to_vec()];
        Ok(config)
    }

    /// The quinn server config (mutual TLS, see [`Self::server_config`]).
    pub fn quic_server_config(&self) -> Result<quinn::ServerConfig, Error> {
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(self.server_config()?)
            .map_err(|e| Error::Tls {
                context: "QUIC server config",
                reason: e.to_string(),
            })?;
        Ok(quinn::ServerConfig::with_crypto(Arc::new(crypto)))
    }

    /// The quinn client config (see [`Self::client_config`]).
    pub fn quic_client_config(&self) -> Result<quinn::ClientConfig, Error> {
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(self.client_config()?)
            .map_err(|e| Error::Tls {
                context: "QUIC client config",
                reason: e.to_string(),
            })?;
        Ok(quinn::ClientConfig::new(Arc::new(crypto)))
    }
}

/// The TLS server name of a proc.
pub fn server_name(proc: &ProcId) -> Result<ServerName<'static>, Error> {
    Ok(ServerName::DnsName(
        DnsName::try_from(proc.as_str().to_owned()).map_err(|e| Error::Certificate {
            context: "proc id as DNS name",
            reason: e.to_string(),
        })?,
    ))
}

/// Checks that a (chain-verified) peer certificate chain names `proc`.
pub fn verify_proc_identity(chain: &[CertificateDer<'_>], proc: &ProcId) -> Result<(), Error> {
    let leaf = chain.first().ok_or_else(|| Error::Identity {
        claimed: proc.clone(),
        reason: "no certificate".into(),
    })?;
    let cert = webpki::EndEntityCert::try_from(leaf).map_err(|e| Error::Identity {
        claimed: proc.clone(),
        reason: format!("unparsable certificate: {e}"),
    })?;
    cert.verify_is_valid_for_subject_name(&server_name(proc)?)
        .map_err(|e| Error::Identity {
            claimed: proc.clone(),
            reason: format!("certificate does not name it: {e}"),
        })
}

fn pem(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk.len();
        let v = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= n {
                b64.push(ALPHABET[((v >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn write_file(path: &Path, bytes: &[u8], mode: u32) -> Result<(), Error> {
    let io = |e: std::io::Error| Error::Io {
        context: "write credentials",
        path: Some(PathBuf::from(path)),
        source: e,
    };
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(path)
        .map_err(io)?;
    file.write_all(bytes).map_err(io)
}

fn read_file(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path).map_err(|e| Error::Io {
        context: "read credentials",
        path: Some(PathBuf::from(path)),
        source: e,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_certificates_name_their_proc_and_load_back() {
        let ca = ClusterCa::generate("test CA").unwrap();
        let alice = ProcId::new("alice").unwrap();
        let creds = ca.issue(&alice).unwrap();
        verify_proc_identity(creds.chain(), &alice).unwrap();
        let bob = ProcId::new("bob").unwrap();
        assert!(matches!(
            verify_proc_identity(creds.chain(), &bob),
            Err(Error::Identity { .. })
        ));
        let (chain, key, ca_pem) = creds.to_pem();
        let loaded = ProcCredentials::from_pem(alice.clone(), &chain, &key, &ca_pem).unwrap();
        assert_eq!(loaded.chain(), creds.chain());
        assert!(ProcCredentials::from_pem(bob, &chain, &key, &ca_pem).is_err());
        assert!(!format!("{creds:?}").contains("PRIVATE"));
        // A CA loaded back from PEM issues certificates that the original
        // CA's trust accepts.
        let dir = std::env::temp_dir().join(format!("regent-net-tls-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        ca.save(&dir).unwrap();
        let again = ClusterCa::load(&dir).unwrap();
        let carol = again.issue(&ProcId::new("carol").unwrap()).unwrap();
        assert_eq!(carol.ca(), ca.cert_der());
        creds.save(&dir).unwrap();
        let back = ProcCredentials::load(&dir, alice).unwrap();
        assert_eq!(back.chain(), creds.chain());
        fs::remove_dir_all(&dir).unwrap();
        // Configs build.
        creds.quic_server_config().unwrap();
        creds.quic_client_config().unwrap();
    }

    #[test]
    fn pem_matches_rcgen() {
        let key = KeyPair::generate().unwrap();
        assert_eq!(
            pem("PRIVATE KEY", &key.serialize_der()).replace('\r', ""),
            key.serialize_pem().replace('\r', "")
        );
    }
}
