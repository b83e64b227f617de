//! Tree verification on a real model: every node's logits from one tree pass are bit-identical to plain
//! decoding of the same path, and committing an accepted path leaves the KV cache exactly as plain
//! decoding would.

mod common;

use eddy::backend::Cpu;
use eddy::models::forward::{forward, forward_tree, Logits, Workspace};
use eddy::state::SeqState;
use eddy::tree::{TreePaths, NO_PARENT};

struct Ctx {
    lm: eddy::load::LoadedModel,
    be: Cpu,
}

fn load(file: &str) -> Option<Ctx> {
    let p = common::model_path(file)?;
    let lm = eddy::load::load_gguf(&p, &mut |_, _| {}).unwrap();
    Some(Ctx { lm, be: Cpu::new(common::threads()) })
}

fn new_state(c: &Ctx, ctx: usize) -> SeqState {
    let cfg = &c.lm.model.config;
    SeqState::new(&c.be, cfg.n_layers, ctx, cfg.kv_dim())
}

/// Logits after plain prefill of `prefix` then one-token decode steps of `path`: one row per path token.
fn plain(c: &Ctx, ws: &mut Workspace, prefix: &[u32], path: &[u32]) -> Vec<Vec<f32>> {
    let mut st = new_state(c, 128);
    let mut lg = Vec::new();
    forward(&c.lm.model, &c.be, ws, &mut st, prefix, Logits::None, &mut lg).unwrap();
    path.iter()
        .map(|&t| {
            forward(&c.lm.model, &c.be, ws, &mut st, &[t], Logits::Last, &mut lg).unwrap();
            lg.clone()
        })
        .collect()
}

#[test]
fn tree_logits_equal_plain_decode_and_commit_compacts() {
    for file in ["SmolLM2-135M-Instruct.Q4_1.gguf", "gemma-3-270m-q4_k_m.gguf"] {
        let Some(c) = load(file) else { return };
        let vocab = c.lm.model.config.vocab_size;
        let mut ws = Workspace::new(&c.be, &c.lm.model, 256);
        let prefix = c.lm.tokenizer.encode("def merge(a, b):\n    out = []", false).unwrap();
        //        0
        //     1  2  3
        //    4 5    6
        //    7      8 9
        let parents = [NO_PARENT, 0, 0, 0, 1, 1, 3, 4, 6, 6];
        let tokens: Vec<u32> = [198u32, 262, 220, 1000, 13, 11, 352, 29, 7, 84].iter().map(|&t| t % vocab as u32).collect();
        let paths = TreePaths::new(&parents).unwrap();
        let mut st = new_state(&c, 128);
        let mut lg = Vec::new();
        forward(&c.lm.model, &c.be, &mut ws, &mut st, &prefix, Logits::None, &mut lg).unwrap();
        // Two incremental calls (nodes 0..4, then 4..10), as a drafter builds its tree.
        let mut tree_logits = Vec::new();
        forward_tree(&c.lm.model, &c.be, &mut ws, &mut st, &tokens[..4], &TreePaths::new(&parents[..4]).unwrap(), 0, &mut lg).unwrap();
        tree_logits.extend_from_slice(&lg);
        forward_tree(&c.lm.model, &c.be, &mut ws, &mut st, &tokens, &paths, 4, &mut lg).unwrap();
        tree_logits.extend_from_slice(&lg);
        assert_eq!(tree_logits.len(), 10 * vocab);
        assert_eq!(st.n_past(), prefix.len(), "a verify pass must not commit");
        for leaf in [7usize, 5, 2, 8, 9] {
            let path: Vec<u32> = paths.path(leaf).iter().map(|&n| tokens[n as usize]).collect();
            let want = plain(&c, &mut ws, &prefix, &path);
            for (d, &node) in paths.path(leaf).iter().enumerate() {
                let got = &tree_logits[node as usize * vocab..][..vocab];
                assert!(got == &want[d][..], "{file}: node {node} (depth {d}) differs from plain decode");
            }
        }
        // Commit the path 0 → 3 → 6 → 9, then decode one more token: identical to plain decoding.
        st.commit_path(&c.be, &tokens, &[0, 3, 6, 9]).unwrap();
        assert_eq!(&st.tokens[prefix.len()..], &[tokens[0], tokens[3], tokens[6], tokens[9]]);
        forward(&c.lm.model, &c.be, &mut ws, &mut st, &[42], Logits::Last, &mut lg).unwrap();
        let want = plain(&c, &mut ws, &prefix, &[tokens[0], tokens[3], tokens[6], tokens[9], 42]);
        assert!(lg == want[4], "{file}: decode after commit differs from plain decode");
    }
}
