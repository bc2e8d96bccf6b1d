import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(x, 2)
        return self.fc(torch.flatten(x, 1))


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 1, 8, 8, generator=g)
    y = torch.randint(0, 10, (32,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)


def train(model, loader, opt):
    model.train()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()


def evaluate(model, loader):
    model.eval()
    correct = 0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        correct += (model(x).argmax(1) == y).sum().item()
    return correct


def main():
    noise = torch.randn(8).to(device)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = make_data()
    for epoch in range(2):
        train(model, loader, opt)
        print(epoch, evaluate(model, loader), noise.sum().item())


if __name__ == "__main__":
    main()
