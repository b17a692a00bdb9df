/*
 * A full checkpoint/restore cycle through libbelayer, as an RL framework written in C would
 * drive it: create, exec, checkpoint, kill from outside, restore, verify; plus the event
 * stream and bad input across the ABI.
 *
 * Usage: cycle <belayerd socket> <busybox rootfs>. Exit 0 on success; on failure prints the
 * failed check with belayer_last_error() and exits 1.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "belayer.h"
#include "check.h"

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Waits for an event of `kind` on `sub` for sandbox `id`, up to ~20 s. */
static int wait_event(BelayerSubscription sub, int kind, const char *id, uint64_t *prefix) {
    for (int i = 0; i < 40; i++) {
        BelayerEvent ev;
        int rc = belayer_next_event(sub, 500, &ev);
        if (rc == BELAYER_E_TIMEOUT) continue;
        if (rc != BELAYER_OK) return rc;
        int match = ev.kind == kind && strcmp(ev.sandbox, id) == 0;
        if (match && prefix) *prefix = ev.prefix;
        belayer_event_free(&ev);
        if (match) return BELAYER_OK;
    }
    return BELAYER_E_TIMEOUT;
}

static int bad_input(BelayerClient client, const char *id) {
    BelayerExecResult r;
    BelayerBuf b;
    BelayerClient other = 0;
    const char bad_utf8[] = {(char)0xff, (char)0xfe, 0};

    CHECK(belayer_connect(NULL, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(strstr(belayer_last_error(), "out") != NULL);
    CHECK(belayer_exec(client, NULL, "true", 0, &r) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_exec(client, id, "true", 0, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_exec(client, bad_utf8, "true", 0, &r) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(strstr(belayer_last_error(), "UTF-8") != NULL);
    CHECK(belayer_exec(client, "no-such-sandbox", "true", 0, &r) == BELAYER_E_UNKNOWN_SANDBOX);
    belayer_exec_result_free(&r); /* zeroed by the failed call: safe */
    CHECK(belayer_checkpoint(client, id, 1, NULL, 5, NULL) == BELAYER_E_INVALID_ARGUMENT);
    CHECK(belayer_context_lookup(client, "never-written", -1, NULL, &b) == BELAYER_E_NOT_FOUND);
    CHECK(belayer_exec(12345678, id, "true", 0, &r) == BELAYER_E_BAD_HANDLE);
    /* A closed handle is detected, never dereferenced. */
    OK(belayer_connect(getenv("BELAYER_SOCKET"), &other));
    OK(belayer_close(other));
    CHECK(belayer_exec(other, id, "true", 0, &r) == BELAYER_E_BAD_HANDLE);
    CHECK(belayer_close(other) == BELAYER_E_BAD_HANDLE);
    CHECK(belayer_connect("/nonexistent/belayer.sock", &other) == BELAYER_E_CONNECT);
    CHECK(strstr(belayer_last_error(), "/nonexistent/belayer.sock") != NULL);
    return 0;
out:
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <socket> <busybox rootfs>\n", argv[0]);
        return 2;
    }
    const char *socket = argv[1];
    const char *rootfs = argv[2];
    setenv("BELAYER_SOCKET", socket, 1);
    BelayerClient client = 0;
    BelayerSubscription sub = 0;
    char *id = NULL;
    char *version = NULL;
    BelayerExecResult r = {0};
    BelayerCheckpointInfo ck = {0};
    BelayerSandboxInfo info = {0};
    BelayerRestoreInfo restored = {0};
    BelayerBuf ctx = {0};
    const char context[] = "messages up to action 2";
    uint64_t prefix = 0;

    CHECK(belayer_abi_version() == BELAYER_ABI_VERSION);
    OK(belayer_connect(socket, &client));
    OK(belayer_ping(client, &version));
    printf("daemon %s, library %s, ABI %u\n", version, belayer_version(), belayer_abi_version());
    belayer_string_free(&version);
    OK(belayer_subscribe(socket, &sub));

    int rc = belayer_image_import(client, "busybox", rootfs);
    CHECK(rc == BELAYER_OK || rc == BELAYER_E_ALREADY_EXISTS);
    OK(belayer_sandbox_create(client, "busybox", "c-cycle", &id));
    printf("sandbox %s\n", id);

    /* Two actions that change the environment. */
    OK(belayer_exec(client, id, "echo one > /root/state && echo out && echo err >&2", 30000, &r));
    CHECK(r.exit_code == 0);
    CHECK(r.stdout_buf.len == 4 && memcmp(r.stdout_buf.data, "out\n", 4) == 0);
    CHECK(r.stderr_buf.len == 4 && memcmp(r.stderr_buf.data, "err\n", 4) == 0);
    belayer_exec_result_free(&r);

    /* An action with options: stdin, env, cwd, stdout and stderr merged. It changes nothing. */
    const char *env[] = {"WHO=c"};
    BelayerExecOptions opts = {0};
    opts.cwd = "/tmp";
    opts.env = env;
    opts.env_len = 1;
    opts.timeout_ms = 30000;
    opts.merge_stderr = 1;
    opts.stdin_data = (const uint8_t *)"in\0put";
    opts.stdin_len = 6;
    BelayerExecVerdict verdict;
    OK(belayer_exec_with(client, id, "pwd; echo $WHO >&2; cat", &opts, &r, &verdict));
    CHECK(r.exit_code == 0);
    CHECK(r.stdout_buf.len == 13 && memcmp(r.stdout_buf.data, "/tmp\nc\nin\0put", 13) == 0);
    CHECK(r.stderr_buf.len == 0);
    CHECK(verdict.infra_fault == BELAYER_INFRA_FAULT_NONE);
    CHECK(verdict.dirty != BELAYER_DIRTY_CHANGED);
    belayer_exec_result_free(&r);
    /* A writing action's verdict. */
    OK(belayer_exec_with(client, id, "echo v > /root/verdict", NULL, &r, &verdict));
    CHECK(verdict.dirty != BELAYER_DIRTY_CLEAN);
    belayer_exec_result_free(&r);
    OK(belayer_exec(client, id, "echo two >> /root/state; exit 3", 30000, &r));
    CHECK(r.exit_code == 3);
    belayer_exec_result_free(&r);

    /* Checkpoint at k = 2 with the LLM context, and its event. */
    OK(belayer_context_append(client, id, 2, (const uint8_t *)context, strlen(context), NULL));
    OK(belayer_checkpoint(client, id, 2, (const uint8_t *)context, strlen(context), &ck));
    CHECK(ck.prefix == 2 && ck.bytes > 0 && ck.name != NULL);
    printf("checkpoint %s: %llu bytes, frozen %.1f ms\n", ck.name,
           (unsigned long long)ck.bytes, ck.frozen_ms);
    belayer_checkpoint_info_free(&ck);
    OK(wait_event(sub, BELAYER_EVENT_CHECKPOINT_READY, id, &prefix));
    CHECK(prefix == 2);

    /* An action after the checkpoint, lost by the failure. */
    OK(belayer_exec(client, id, "echo three >> /root/state", 30000, &r));
    belayer_exec_result_free(&r);

    /* Kill every process of the sandbox from outside (a fail-stop). */
    OK(belayer_sandbox_inspect(client, id, &info));
    CHECK(info.pids_len > 0);
    for (size_t i = 0; i < info.pids_len; i++) kill(info.pids[i], SIGKILL);
    belayer_sandbox_info_free(&info);
    OK(wait_event(sub, BELAYER_EVENT_SANDBOX_FAILED, id, NULL));
    for (int i = 0; i < 100; i++) {
        OK(belayer_sandbox_inspect(client, id, &info));
        int failed = strcmp(info.state, "failed") == 0;
        belayer_sandbox_info_free(&info);
        if (failed) break;
        sleep_ms(50);
    }

    /* Restore: k = 2, the context recorded with C_2, the environment of k = 2. */
    OK(belayer_restore(client, id, true, &restored));
    CHECK(restored.has_prefix && restored.prefix == 2);
    CHECK(restored.context.len == strlen(context));
    CHECK(memcmp(restored.context.data, context, strlen(context)) == 0);
    CHECK(restored.verified && restored.fs_matches && restored.processes_match);
    printf("restored k=%llu in %.1f ms\n", (unsigned long long)restored.prefix,
           restored.total_ms);
    belayer_restore_info_free(&restored);
    OK(belayer_exec(client, id, "cat /root/state", 30000, &r));
    CHECK(r.stdout_buf.len == 8 && memcmp(r.stdout_buf.data, "one\ntwo\n", 8) == 0);
    belayer_exec_result_free(&r);
    OK(belayer_context_lookup(client, id, -1, &prefix, &ctx));
    CHECK(prefix == 2 && ctx.len == strlen(context));
    belayer_buf_free(&ctx);

    if (bad_input(client, id)) goto out;

    OK(belayer_sandbox_destroy(client, id));
    CHECK(belayer_sandbox_destroy(client, id) == BELAYER_E_UNKNOWN_SANDBOX);
    printf("cycle ok\n");
out:
    belayer_string_free(&id);
    if (sub) belayer_unsubscribe(sub);
    if (client) belayer_close(client);
    return failures ? 1 : 0;
}
