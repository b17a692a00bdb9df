//! Event streams over a real socket: `Request::Subscribe` turns a connection into a stream of
//! events from the handler's channel; a handler without one answers `Unsupported`.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use belayer_ipc::{
    Client, ClientError, ErrorCode, Event, Handler, PeerCred, Request, Response, Server,
    ServerConfig,
};

#[derive(Default)]
struct Bus {
    subscribers: Mutex<Vec<Sender<Event>>>,
}

impl Bus {
    fn publish(&self, event: Event) {
        self.subscribers
            .lock()
            .unwrap()
            .retain(|tx| tx.send(event.clone()).is_ok());
    }
}

impl Handler for Bus {
    fn handle(&self, _peer: &PeerCred, _request: Request) -> Response {
        Response::Done
    }

    fn subscribe(&self, _peer: &PeerCred) -> Option<Receiver<Event>> {
        let (tx, rx) = mpsc::channel();
        self.subscribers.lock().unwrap().push(tx);
        Some(rx)
    }
}

struct Plain;

impl Handler for Plain {
    fn handle(&self, _peer: &PeerCred, _request: Request) -> Response {
        Response::Done
    }
}

#[test]
fn subscribers_receive_events_until_they_leave() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("events.sock");
    let bus = Arc::new(Bus::default());
    let server = Server::bind(ServerConfig::new(&path))
        .unwrap()
        .spawn(bus.clone())
        .unwrap();
    let mut sub = Client::connect(&path).unwrap().subscribe().unwrap();
    assert_eq!(
        sub.next_event(Some(Duration::from_millis(50))).unwrap(),
        None
    );
    // Requests on other connections still work while a stream is open.
    assert_eq!(
        Client::connect(&path).unwrap().call(Request::Ping).unwrap(),
        Response::Done
    );
    let ready = Event::CheckpointReady {
        id: "sb".into(),
        prefix: 3,
    };
    bus.publish(ready.clone());
    assert_eq!(
        sub.next_event(Some(Duration::from_secs(5))).unwrap(),
        Some(ready)
    );
    drop(sub);
    // The server notices the subscriber left and drops its channel.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        bus.publish(Event::SandboxFailed {
            id: "sb".into(),
            reason: "test".into(),
        });
        if bus.subscribers.lock().unwrap().is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "subscriber never dropped"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Shutting the server down ends open streams.
    let mut sub = Client::connect(&path).unwrap().subscribe().unwrap();
    server.shutdown().unwrap();
    match sub.next_event(Some(Duration::from_secs(5))) {
        Err(ClientError::ClosedByServer { .. }) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_handler_without_events_refuses_subscriptions() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.sock");
    let server = Server::bind(ServerConfig::new(&path))
        .unwrap()
        .spawn(Arc::new(Plain))
        .unwrap();
    match Client::connect(&path).unwrap().subscribe() {
        Err(ClientError::SubscribeRefused { code, .. }) => assert_eq!(code, ErrorCode::Unsupported),
        other => panic!("{other:?}"),
    }
    server.shutdown().unwrap();
}
