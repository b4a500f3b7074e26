//! A model's layers across hosts: ggml's RPC backend in the worker (`serve --rpc`).
//!
//! Each `--rpc HOST:PORT` is a ggml `rpc-server` (llama.cpp's `ggml-rpc-server`, built by
//! `scripts/build-llama-tool.sh`): it holds the layers placed on it and computes them when the
//! worker's graph reaches them. The worker registers each server as a ggml device before the model
//! loads ([`register`]); llama.cpp puts RPC devices first in the model's device list, in the order
//! registered, and places the last layers (and the output layer) on them, split by the weights.
//! Everything above the worker (sessions, the log, the scheduler) is unchanged.
//!
//! `--tensor-split` takes one weight per server, as llama-server does (all layers offloaded), or
//! one more for this machine's CPU, which then keeps that share of the layers ([`Placement`]).
//!
//! What this module knows of failure: ggml aborts the process when a server cannot be reached or
//! drops the connection (`GGML_ABORT`, ggml-rpc.cpp), so a lost server is a worker death. The lane
//! probes the servers before each start and names the one that is down
//! (`actors::lane`, docs/scale.md).

use std::ffi::{c_char, CString};
use std::path::Path;

use llama_cpp_2::model::LlamaModel;

use super::EngineError;

/// ggml's `GGML_RPC_MAX_SERVERS`.
pub const MAX_SERVERS: usize = 16;

/// Where a model's layers go: the RPC servers, in `--rpc` order, and the `--tensor-split`
/// weights (empty: split by the servers' free memory, every layer offloaded).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Placement {
    pub servers: Vec<String>,
    pub split: Vec<f32>,
}

/// Parses `--rpc HOST:PORT[,HOST:PORT...]`: each a host name or address (IPv6 in brackets) and a
/// port 1..=65535; no duplicates; at most [`MAX_SERVERS`].
pub fn parse_servers(s: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (host, port) = part
            .rsplit_once(':')
            .ok_or_else(|| format!("--rpc {part:?}: expected HOST:PORT"))?;
        let bare = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if bare.is_empty()
            || !bare
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | ':' | '_'))
        {
            return Err(format!(
                "--rpc {part:?}: {host:?} is not a host name or address"
            ));
        }
        match port.parse::<u16>() {
            Ok(p) if p > 0 => {}
            _ => return Err(format!("--rpc {part:?}: {port:?} is not a port (1-65535)")),
        }
        if out.iter().any(|o| o == part) {
            return Err(format!("--rpc names {part} twice"));
        }
        out.push(part.to_string());
    }
    if out.len() > MAX_SERVERS {
        return Err(format!(
            "--rpc names {} servers; ggml takes at most {MAX_SERVERS}",
            out.len()
        ));
    }
    Ok(out)
}

/// Parses `--tensor-split W1,W2,...`: finite weights, none negative, not all zero.
pub fn parse_split(s: &str) -> Result<Vec<f32>, String> {
    let weights = s
        .split(',')
        .map(|w| match w.trim().parse::<f32>() {
            Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
            _ => Err(format!(
                "--tensor-split: {w:?} is not a weight (a number, 0 or more)"
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if weights.iter().all(|w| *w == 0.0) {
        return Err("--tensor-split: every weight is 0".into());
    }
    Ok(weights)
}

impl Placement {
    /// Checks the weights fit the servers: one each, or one more for the local CPU.
    pub fn check(&self) -> Result<(), String> {
        let (n, w) = (self.servers.len(), self.split.len());
        if n == 0 {
            return if w == 0 {
                Ok(())
            } else {
                Err("--tensor-split weights the --rpc servers; give --rpc too".into())
            };
        }
        if w != 0 && w != n && w != n + 1 {
            return Err(format!(
                "--tensor-split has {w} weights for {n} --rpc servers: give {n} (one per \
                 server) or {} (the last for this machine's CPU)",
                n + 1
            ));
        }
        if w == n && w > 0 && self.split.iter().all(|x| *x == 0.0) {
            return Err("--tensor-split gives every --rpc server 0".into());
        }
        Ok(())
    }

    /// How many of a model's `n_layer` blocks (plus its output layer) go to the servers, and the
    /// weights llama.cpp splits them by (one per server; all 0 means by free memory). With a
    /// weight for the local CPU, that share of the `n_layer + 1` layers stays here; the servers
    /// always get at least one layer, and the output layer is the first to go to them.
    pub fn offload(&self, n_layer: u32) -> (u32, Vec<f32>) {
        let total = n_layer + 1;
        let n = self.servers.len();
        if self.split.len() <= n {
            let split = if self.split.is_empty() {
                vec![0.0; n]
            } else {
                self.split.clone()
            };
            return (total, split);
        }
        let remote: f64 = self.split[..n].iter().map(|w| f64::from(*w)).sum();
        let all = remote + f64::from(self.split[n]);
        let layers = ((f64::from(total) * remote / all).round() as u32).clamp(1, total);
        (layers, self.split[..n].to_vec())
    }
}

/// The RPC protocol's major version the worker's ggml speaks (`RPC_PROTO_MAJOR_VERSION` in
/// llama-cpp-sys-2's ggml-rpc.h); a server of another major version refuses it.
pub const PROTO_MAJOR: u8 = 7;
/// The newest minor version of [`PROTO_MAJOR`] the worker's ggml takes
/// (`RPC_PROTO_MINOR_VERSION`): ggml refuses a server of a newer one.
pub const PROTO_MINOR: u8 = 0;
/// ggml-rpc's `RPC_CMD_HELLO` (fixed at 14 across versions).
const CMD_HELLO: u8 = 14;
/// The size of `conn_caps` in ggml-rpc's hello messages (transport.h).
const CONN_CAPS: usize = 24;
/// The size of a hello reply: major, minor, patch, padding, `conn_caps`.
pub const HELLO_REPLY: usize = 4 + CONN_CAPS;

/// The first command a ggml RPC server takes from a client, as the worker's ggml sends it
/// (command byte, little-endian u64 size, a request of `conn_caps` all zero: plain TCP). A
/// server answers it only once it has accepted the connection, so the answer tells a running
/// server from one whose listening socket outlives its process for a moment (ggml closes a
/// dying server's client connections first, and a connect to its listener still succeeds).
pub fn hello_request() -> Vec<u8> {
    let mut out = Vec::with_capacity(1 + 8 + CONN_CAPS);
    out.push(CMD_HELLO);
    out.extend_from_slice(&(CONN_CAPS as u64).to_le_bytes());
    out.extend_from_slice(&[0; CONN_CAPS]);
    out
}

/// Checks a hello reply's size header (the 8 bytes before its body): the body must be
/// [`HELLO_REPLY`] bytes, read before anything else is.
pub fn hello_reply_size(header: [u8; 8]) -> Result<(), String> {
    match u64::from_le_bytes(header) {
        n if n == HELLO_REPLY as u64 => Ok(()),
        n => Err(format!(
            "it answered a hello of {n} bytes, not {HELLO_REPLY}: not a ggml RPC server of \
             protocol {PROTO_MAJOR}.x"
        )),
    }
}

/// Checks a hello reply's body as the worker's ggml does: the server's protocol must be the
/// worker's major version, at most its minor one.
pub fn hello_reply(body: &[u8; HELLO_REPLY]) -> Result<(), String> {
    let (major, minor, patch) = (body[0], body[1], body[2]);
    if major == PROTO_MAJOR && minor.cmp(&PROTO_MINOR) != std::cmp::Ordering::Greater {
        Ok(())
    } else {
        Err(format!(
            "it speaks RPC protocol {major}.{minor}.{patch}, this build {PROTO_MAJOR}.{PROTO_MINOR} \
             (build its ggml-rpc-server from the same llama.cpp: scripts/build-llama-tool.sh)"
        ))
    }
}

/// Registers each server as a ggml device (llama-server's `add_rpc_devices`). Call once per
/// process, after the backend is initialised and before the model loads.
///
/// ggml connects here, and aborts the process if a server cannot be reached: the lane probes
/// them first, so that only a server lost in between ends here.
pub fn register(servers: &[String]) -> Result<(), EngineError> {
    let err = |m: String| EngineError::Rpc(m);
    // SAFETY: plain C calls on ggml's process-wide registry; every string outlives its call.
    unsafe {
        let reg = llama_cpp_sys_2::ggml_backend_reg_by_name(c"RPC".as_ptr());
        if reg.is_null() {
            return Err(err("this build has no RPC backend (GGML_RPC)".into()));
        }
        let f = llama_cpp_sys_2::ggml_backend_reg_get_proc_address(
            reg,
            c"ggml_backend_rpc_add_server".as_ptr(),
        );
        if f.is_null() {
            return Err(err(
                "the RPC backend lacks ggml_backend_rpc_add_server".into()
            ));
        }
        // ggml-rpc.h: `ggml_backend_reg_t ggml_backend_rpc_add_server(const char * endpoint)`.
        type AddServer = unsafe extern "C" fn(*const c_char) -> llama_cpp_sys_2::ggml_backend_reg_t;
        let add = std::mem::transmute::<*mut std::ffi::c_void, AddServer>(f);
        for server in servers {
            let endpoint = CString::new(server.as_str())
                .map_err(|_| err(format!("{server:?} holds a NUL")))?;
            let server_reg = add(endpoint.as_ptr());
            if server_reg.is_null() {
                return Err(err(format!("the RPC server {server} has no devices")));
            }
            llama_cpp_sys_2::ggml_backend_register(server_reg);
            log::info!("RPC server {server} registered");
        }
    }
    Ok(())
}

/// The number of blocks (`<arch>.block_count`) in a GGUF's header.
pub fn n_layer(path: &Path) -> Result<u32, EngineError> {
    let unreadable = |source| EngineError::ModelUnreadable {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(unreadable)?;
    let meta = crate::http::compat::gguf::read_meta(&mut std::io::BufReader::new(file))
        .map_err(unreadable)?;
    let arch = meta
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .unwrap_or("llama")
        .to_string();
    meta.get(&format!("{arch}.block_count"))
        .and_then(|v| v.as_u64())
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| EngineError::Rpc(format!("{} names no block count", path.display())))
}

/// Loads the model with `layers` layers on the registered RPC devices, split by `split` (one
/// weight per device in registration order; all 0: by free memory).
///
/// llama-cpp-2 0.1.160's `LlamaModelParams` has no tensor-split setter, so the parameters are
/// llama.cpp's own (`llama_model_default_params`) and the model is loaded through the C API.
pub fn load(path: &Path, layers: u32, split: &[f32]) -> Result<LlamaModel, EngineError> {
    let load_err = |reason: String| EngineError::ModelLoad {
        path: path.to_path_buf(),
        reason,
    };
    let cpath = CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| load_err("the path holds a NUL".into()))?;
    // SAFETY: `llama_max_devices` is a constant query.
    let max = unsafe { llama_cpp_sys_2::llama_max_devices() };
    let mut weights = vec![0.0f32; max.max(split.len())];
    weights[..split.len()].copy_from_slice(split);
    // SAFETY: default parameters by value; `weights` and `cpath` outlive the load call, which
    // copies what it keeps.
    let raw = unsafe {
        let mut params = llama_cpp_sys_2::llama_model_default_params();
        params.n_gpu_layers = i32::try_from(layers).unwrap_or(i32::MAX);
        params.split_mode = llama_cpp_sys_2::LLAMA_SPLIT_MODE_LAYER;
        params.tensor_split = weights.as_ptr();
        llama_cpp_sys_2::llama_model_load_from_file(cpath.as_ptr(), params)
    };
    let raw = std::ptr::NonNull::new(raw)
        .ok_or_else(|| load_err("llama.cpp returned no model".into()))?;
    // `LlamaModel` is `#[repr(transparent)]` over llama-cpp-2's `Ptr`, itself
    // `#[repr(transparent)]` over `NonNull<llama_model>`: the same layout, checked here.
    const _: () = assert!(
        std::mem::size_of::<LlamaModel>()
            == std::mem::size_of::<std::ptr::NonNull<llama_cpp_sys_2::llama_model>>()
    );
    // SAFETY: the layouts are equal (above), and the pointer is a model llama.cpp just loaded,
    // owned by nothing else: the `LlamaModel` frees it when dropped, as after `load_from_file`.
    Ok(unsafe {
        std::mem::transmute::<std::ptr::NonNull<llama_cpp_sys_2::llama_model>, LlamaModel>(raw)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hello_is_ggml_rpcs_and_its_reply_is_checked() {
        let hello = hello_request();
        assert_eq!(hello.len(), 33);
        assert_eq!(hello[0], 14);
        assert_eq!(&hello[1..9], &24u64.to_le_bytes());
        assert!(hello[9..].iter().all(|b| *b == 0));

        assert!(hello_reply_size(28u64.to_le_bytes()).is_ok());
        let wrong = hello_reply_size(4u64.to_le_bytes()).unwrap_err();
        assert!(wrong.contains("4 bytes, not 28"), "{wrong}");

        let mut body = [0u8; HELLO_REPLY];
        body[..3].copy_from_slice(&[7, 0, 0]);
        assert!(hello_reply(&body).is_ok());
        body[..3].copy_from_slice(&[6, 1, 2]);
        let old = hello_reply(&body).unwrap_err();
        assert!(old.contains("protocol 6.1.2, this build 7.0"), "{old}");
        body[..3].copy_from_slice(&[7, 1, 0]);
        assert!(hello_reply(&body).is_err(), "a newer minor version");
    }

    #[test]
    fn servers_parse_and_are_checked() {
        assert_eq!(
            parse_servers("127.0.0.1:50052, host-b:7000,[::1]:9").unwrap(),
            vec!["127.0.0.1:50052", "host-b:7000", "[::1]:9"]
        );
        for bad in [
            "",
            "host",
            "host:0",
            "host:70000",
            ":80",
            "a b:1",
            "h:1,h:1",
        ] {
            assert!(parse_servers(bad).is_err(), "{bad:?}");
        }
        let many = (1..=17)
            .map(|p| format!("h:{p}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(parse_servers(&many).unwrap_err().contains("at most 16"));
    }

    #[test]
    fn weights_parse_and_fit_the_servers() {
        assert_eq!(parse_split("3, 1").unwrap(), vec![3.0, 1.0]);
        for bad in ["", "x", "-1,2", "0,0", "inf"] {
            assert!(parse_split(bad).is_err(), "{bad:?}");
        }
        let p = |servers: usize, split: &[f32]| Placement {
            servers: (0..servers).map(|i| format!("h:{}", i + 1)).collect(),
            split: split.to_vec(),
        };
        assert!(p(2, &[]).check().is_ok());
        assert!(p(2, &[1.0, 1.0]).check().is_ok());
        assert!(p(2, &[1.0, 1.0, 2.0]).check().is_ok());
        assert!(p(2, &[1.0]).check().unwrap_err().contains("give 2"));
        assert!(p(2, &[0.0, 0.0]).check().is_err());
        assert!(p(0, &[1.0]).check().is_err());
        assert!(p(0, &[]).check().is_ok());
    }

    #[test]
    fn the_local_weight_keeps_its_share_of_the_layers() {
        let p = |split: &[f32]| Placement {
            servers: vec!["a:1".into(), "b:2".into()],
            split: split.to_vec(),
        };
        // One weight per server: everything offloaded, split as given.
        assert_eq!(p(&[3.0, 1.0]).offload(30), (31, vec![3.0, 1.0]));
        // None: everything offloaded, split by free memory.
        assert_eq!(p(&[]).offload(30), (31, vec![0.0, 0.0]));
        // Half for this machine: 31 layers (30 blocks and the output), 16 of them remote.
        assert_eq!(p(&[1.0, 1.0, 2.0]).offload(30), (16, vec![1.0, 1.0]));
        // A tiny remote share still offloads one layer; a zero local share offloads all.
        assert_eq!(p(&[0.001, 0.0, 100.0]).offload(30).0, 1);
        assert_eq!(p(&[1.0, 1.0, 0.0]).offload(30).0, 31);
    }
}
